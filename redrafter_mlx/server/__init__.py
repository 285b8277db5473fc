"""The HTTP server of `redrafter-mlx serve`: the HTTP layer (:mod:`.app`, a Starlette
app, on uvicorn with this server's connection protocol, :mod:`.wire`), what the three APIs
share (:mod:`.protocol`: a request's :class:`~.protocol.Call`, an answer's text and tool
calls), and each API's requests and responses (:mod:`.openai`, :mod:`.anthropic`,
:mod:`.responses`). Above the core's generation service; the command that loads the model and
starts it is :mod:`redrafter_mlx.cli.serve`."""
