"""Drafter types, one module each: ReDrafter's RNN (:mod:`.redrafter`, searched by
:mod:`.beam_search`), EAGLE-3, DFlash, DFlash2, DSpark, Qwen3.5's and Nemotron-H's MTP heads and
Gemma 4's assistant. Each implements :class:`redrafter_mlx.core.decode.source.Source`; a folder
or config becomes one through ``redrafter_mlx.io.field_drafters.create_drafter``."""
