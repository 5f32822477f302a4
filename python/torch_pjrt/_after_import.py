"""Runs a patch on a module right after its own code, whether it is imported before or after torch_pjrt.

Nothing here imports the patched module: a finder on sys.meta_path wraps its loader when (and if) it loads.
`after_import` is the whole mechanism for simple patches (serving/hf_batching.py); _accelerate.py builds its
finder from the two pieces below, adding what accelerate's import order and `python -m` launcher need."""
import importlib.abc
import sys


class PatchingLoader(importlib.abc.Loader):
    """A module's own loader, then patch(name, module)."""

    def __init__(self, loader, name, patch):
        self._loader, self._name, self._patch = loader, name, patch

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module):
        self._loader.exec_module(module)
        self._patch(self._name, module)

    def __getattr__(self, attr):  # get_source, get_resource_reader, ...: the real loader's
        return getattr(self._loader, attr)


def spec_with_patch(finder, name, path, target, loader_class, patch):
    """The spec the other finders on sys.meta_path give `name`, its loader wrapped in loader_class; None if none."""
    for other in sys.meta_path:
        if other is finder or not hasattr(other, "find_spec"):
            continue
        spec = other.find_spec(name, path, target)
        if spec is not None:
            break
    else:
        return None
    if spec.loader is not None and hasattr(spec.loader, "exec_module"):
        spec.loader = loader_class(spec.loader, name, patch)
    return spec


_patches: dict = {}  # module name -> patch(module)


def _run_patch(name, module):
    _patches[name](module)


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name not in _patches:
            return None
        return spec_with_patch(self, name, path, target, PatchingLoader, _run_patch)


def after_import(name: str, patch) -> None:
    """Calls patch(module) once module `name` has run its code (now, if it already has)."""
    _patches[name] = patch
    if not any(isinstance(f, _Finder) for f in sys.meta_path):
        sys.meta_path.insert(0, _Finder())
    module = sys.modules.get(name)
    if module is not None:
        patch(module)
