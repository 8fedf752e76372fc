"""Errors a user can act on. The CLI prints their message on one line and exits 2."""


class KvtransError(Exception):
    """Bad input or an unsupported model: the message says what to do."""


class UnsupportedModelError(KvtransError):
    pass


class ModelNotFoundError(KvtransError):
    pass
