"""Serving over the decode core: a conversation (:mod:`.session`) and the server's many
(:mod:`.prompt_cache`), the worker that answers requests (:mod:`.service`), continuous batching
of their steps (:mod:`.scheduler`, :mod:`.batch`) and a target sharded over ranks
(:mod:`.distributed`)."""
