"""The backend's name, as ``init_process_group`` and ``get_backend`` say it."""

BACKEND_NAME = "ringtrain"
