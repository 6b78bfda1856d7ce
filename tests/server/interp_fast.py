"""Fewer redundant re-patches in Triton's CPU interpreter (``TRITON_INTERPRET=1``), for the test
children that run our kernels there.

Every launch patches ``triton.language`` for the interpreter (``_patch_lang``) and restores it
afterwards. Every call of a ``@triton.jit`` device function inside a kernel (``unit_lower_inverse``,
``online_step``, ...) patches the same modules AGAIN (``inspect.getmembers`` over six modules) and
never restores that: the already patched members are no builtins any more, so the second patch
changes nothing but costs ~1 ms per call, a fifth to a third of the time of the engine tests on
the interpreter (tens of thousands of device-function calls). ``install()`` skips a device
function's patch while a launch's patch of the same language modules is in place; anything else
(a launch, a device function seeing other modules) takes Triton's own ``_patch_lang``. What the
kernels compute is unchanged: the interpreter runs the same patched functions either way.
"""

from __future__ import annotations

import inspect


class _Kept:
    """The patch scope of a device function's skipped re-patch (nothing to restore)."""

    def restore(self) -> None:
        pass


def install() -> bool:
    """Install the skip (idempotent); False where Triton or its interpreter internals are absent."""
    try:
        from triton.runtime import interpreter as interp
    except ImportError:
        return False
    real = getattr(interp, "_patch_lang", None)
    if real is None or getattr(real, "_ddtree_skip", False) or not hasattr(interp, "GridExecutor"):
        return real is not None
    active: list[frozenset] = []   # the language modules the running launch patched

    def langs(fn) -> frozenset:
        return frozenset(id(v) for v in fn.__globals__.values() if inspect.ismodule(v)
                         and v in (interp.tl, interp.tl.core))

    def patch_lang(fn):
        mine = langs(fn)
        if active:                    # a device function called inside a running launch
            return _Kept() if mine <= active[-1] else real(fn)
        scope = real(fn)              # a launch: patched until its scope is restored
        active.append(mine)
        restore = scope.restore

        def undo() -> None:
            active.clear()
            restore()

        scope.restore = undo
        return scope

    patch_lang._ddtree_skip = True
    interp._patch_lang = patch_lang
    return True
