"""Fewer redundant re-patches in Triton's CPU interpreter (``TRITON_INTERPRET=1``), for the test
children that run our kernels there.

Every launch patches ``triton.language`` for the interpreter (``_patch_lang``) and restores it
afterwards. Every call of a ``@triton.jit`` device function inside a kernel (``unit_lower_inverse``,
``online_step``, ...) patches the same modules AGAIN (``inspect.getmembers`` over six modules) and
never restores that: the already patched members are no builtins any more, so the second patch
only re-sets the same interpreter stand-ins, but the children make tens of thousands of such calls: a tenth (the GDN tree
kernels) to over a third (the attention kernels, whose split programs call ``online_step`` and
``tl.cdiv`` / ``tl.sum`` per key tile) of their time. ``install()`` patches a set of
language modules (``triton.language``, ``triton.language.core``: the standard library's device
functions see the latter) once per launch: a launch takes Triton's own ``_patch_lang``, and so does
the first device function of the launch that sees a module not patched yet in it; later ones skip.
What the kernels compute is unchanged: the interpreter runs the same patched functions either way
(test_kernels_attention's report, every error bit of it, is the same with and without).
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
    patched: set[int] = set()   # the language modules patched since the running launch began
    running = [False]

    def langs(fn) -> set[int]:
        return {id(v) for v in fn.__globals__.values() if inspect.ismodule(v) and v in (interp.tl, interp.tl.core)}

    def patch_lang(fn):
        mine = langs(fn)
        if running[0]:                # a device function called inside the running launch
            if mine <= patched:
                return _Kept()
            patched.update(mine)
            return real(fn)
        scope = real(fn)              # a launch: patched until its scope is restored
        running[0] = True
        patched.clear()
        patched.update(mine)
        restore = scope.restore

        def undo() -> None:
            running[0] = False
            restore()

        scope.restore = undo
        return scope

    patch_lang._ddtree_skip = True
    interp._patch_lang = patch_lang
    return True
