"""The Triton interpreter, as the tests run it (TRITON_INTERPRET=1): ``patch_the_language_once_per_launch``, called by
tests/conftest.py and by the worker modules of the tests that start processes (their kernels run interpreted
too). Imports nothing heavy until called, so that conftest can import it before TRITON_INTERPRET is read."""

from __future__ import annotations

import inspect


def patch_the_language_once_per_launch() -> None:
    """Under the interpreter, Triton swaps triton.language's builtins for interpreted ones when a kernel is
    launched (and swaps them back after it), and again at every call of a @triton.jit helper inside the kernel,
    where it scans every member of the language modules to find nothing left to swap: a quarter of the time of the
    interpreted tests. This makes the helper's call skip that scan when the modules its code reads are swapped
    already (their ``load`` is no longer a builtin), which is all the scan would find; the kernels run the same
    interpreted code. Where Triton's interpreter is laid out otherwise (another version), it is left as it is."""
    try:
        import triton.language as tl
        from triton.runtime import interpreter
    except ImportError:
        return
    patch_lang, scope_class = getattr(interpreter, "_patch_lang", None), getattr(interpreter, "_LangPatchScope", None)
    if patch_lang is None or scope_class is None or not hasattr(tl.core, "is_builtin"):
        return
    if getattr(patch_lang, "skips_swapped_languages", False):  # installed already (conftest, then a worker module)
        return

    def swapped(lang) -> bool:
        return not tl.core.is_builtin(getattr(lang, "load", None))

    def patch_lang_unless_swapped(fn):
        langs = [value for value in fn.__globals__.values() if inspect.ismodule(value) and value in (tl, tl.core)]
        if langs and all(swapped(lang) for lang in langs):
            return scope_class()  # nothing to swap, nothing to restore
        return patch_lang(fn)

    patch_lang_unless_swapped.skips_swapped_languages = True
    interpreter._patch_lang = patch_lang_unless_swapped
