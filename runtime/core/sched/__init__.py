"""The scheduler (``scheduler``), what it outputs (``output``) and its waiting queues (``request_queue``)."""
