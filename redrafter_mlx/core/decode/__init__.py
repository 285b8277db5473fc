"""The decode algorithm: a sequence's state (:mod:`.sequence`, :mod:`.cache`, :mod:`.recurrent`),
the target's verify forward (:mod:`.llm`, :mod:`.joint`), trees and acceptance (:mod:`.tree`,
:mod:`.accept`), the autoregressive and speculative steps (:mod:`.autoregressive`,
:mod:`.speculative`) behind one :class:`~.decoder.Decoder`, and the interface every drafter
implements for the step (:class:`~.source.Source`; prompt lookup, :mod:`.lookup`, is one)."""
