"""Runs a patch on a module right after its own code, whether it is imported before or after torch_pjrt.

Nothing here imports the patched module: a finder on sys.meta_path wraps its loader when (and if) it loads."""
import importlib.abc
import sys

_patches: dict = {}  # module name -> patch(module)


class _PatchingLoader(importlib.abc.Loader):
    def __init__(self, loader, name):
        self._loader, self._name = loader, name

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module):
        self._loader.exec_module(module)
        _patches[self._name](module)

    def __getattr__(self, attr):  # get_source, get_resource_reader, ...: the real loader's
        return getattr(self._loader, attr)


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name not in _patches:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(name, path, target)
            if spec is not None:
                break
        else:
            return None
        if spec.loader is not None and hasattr(spec.loader, "exec_module"):
            spec.loader = _PatchingLoader(spec.loader, name)
        return spec


def after_import(name: str, patch) -> None:
    """Calls patch(module) once module `name` has run its code (now, if it already has)."""
    _patches[name] = patch
    if not any(isinstance(f, _Finder) for f in sys.meta_path):
        sys.meta_path.insert(0, _Finder())
    module = sys.modules.get(name)
    if module is not None:
        patch(module)
