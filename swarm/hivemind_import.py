"""hivemind, imported once with the one warning it triggers under a current torch filtered out.

hivemind decorates two helpers with ``torch.jit.script`` at import, which current torch releases warn
about (a DeprecationWarning or FutureWarning, by release). The warning is about hivemind's code, not
the user's, so the applications (``peer``, ``coordinator``) import hivemind through this module first.
Only that message, only during that import, is filtered.
"""

from __future__ import annotations

import warnings

with warnings.catch_warnings():
    warnings.filterwarnings("ignore", message=r"`torch\.jit\.script` is (deprecated|not supported)")
    import hivemind

__all__ = ["hivemind"]
