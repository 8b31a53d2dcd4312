"""HTTP pieces the server (``kvfleet serve``) and the router (``kvfleet router``) share: the draining
uvicorn server (:mod:`.draining`), the bearer-token check (:mod:`.auth`) and OpenAI's error body
(:mod:`.errors`). Torch-free, nothing of kvfleet imported: the router loads it."""
