"""Logging of the serving code: Triton's own log inside Triton, a plain `logging` logger outside.

Every module of backend_lib logs through `logging` (loggers under "backend_lib"). Inside a Triton model
process, setup(pb_utils) routes those records to pb_utils.Logger, so the server's flags decide what is
written and where: `--log-verbose=N` (DEBUG records are Triton's verbose lines), `--log-info`,
`--log-warning`, `--log-error`, `--log-file` and `--log-format` (default or ISO8601), all in the
server's line format. Outside Triton (CLIs, tests, the bench) setup() without pb_utils writes to stderr
at $QWEN3_LOG_LEVEL (INFO by default).

Usage (the only place that configures logging for the serving code):

    from .log import get_logger, setup
    log = get_logger()            # "backend_lib.triton"
    setup(pb_utils)               # in a model's initialize
"""
from __future__ import annotations

import logging
import os
import threading

ROOT = "backend_lib"
LEVEL_ENV = "QWEN3_LOG_LEVEL"


def get_logger(name: str = "triton") -> logging.Logger:
    return logging.getLogger(f"{ROOT}.{name}")


class TritonLogHandler(logging.Handler):
    """Forwards records to pb_utils.Logger: DEBUG -> log_verbose, INFO -> log_info, WARNING -> log_warn,
    ERROR and above -> log_error. Triton filters them by its flags; every record is passed on."""

    def __init__(self, logger):
        super().__init__(logging.DEBUG)
        self.logger = logger
        self.setFormatter(logging.Formatter("%(message)s"))

    def emit(self, record: logging.LogRecord) -> None:
        try:
            message = self.format(record)
            if record.levelno >= logging.ERROR:
                self.logger.log_error(message)
            elif record.levelno >= logging.WARNING:
                self.logger.log_warn(message)
            elif record.levelno >= logging.INFO:
                self.logger.log_info(message)
            else:
                self.logger.log_verbose(message)
        except Exception:
            self.handleError(record)


def setup(pb_utils=None) -> logging.Logger:
    """Configures the "backend_lib" logger once per process (idempotent) and returns it.

    With pb_utils (a Triton model): every record goes to Triton's log, which filters by its flags (a
    $QWEN3_LOG_LEVEL, when set, drops records below it before they reach Triton). Without: a stderr
    handler at $QWEN3_LOG_LEVEL (INFO by default). An unknown level is an error naming the variable."""
    root = logging.getLogger(ROOT)
    if any(getattr(h, "_qwen3", False) for h in root.handlers):
        return root
    raw = os.environ.get(LEVEL_ENV, "").strip().upper()
    level = logging.getLevelName(raw) if raw else None
    if raw and not isinstance(level, int):
        raise ValueError(f"${LEVEL_ENV}: {raw!r} is not a logging level (DEBUG, INFO, WARNING, ERROR)")
    if pb_utils is not None:
        handler: logging.Handler = TritonLogHandler(pb_utils.Logger)
        level = level or logging.DEBUG
    else:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(asctime)s %(name)s %(levelname)s: %(message)s"))
        level = level or logging.INFO
    handler._qwen3 = True
    if pb_utils is not None:
        _log_thread_deaths(root)
    root.addHandler(handler)
    root.setLevel(level)
    root.propagate = False
    return root


def _log_thread_deaths(root: logging.Logger) -> None:
    """An exception that ends a thread (an engine thread that dies, say) goes to Triton's log with its
    traceback, not to the stub's stderr."""
    def hook(args):
        if args.exc_type is SystemExit:
            return
        root.getChild("thread").error("thread %s died", getattr(args.thread, "name", "?"),
                                      exc_info=(args.exc_type, args.exc_value, args.exc_traceback))

    threading.excepthook = hook
