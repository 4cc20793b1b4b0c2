"""Ships the example policies (`policies/*.yaml`) inside the package as `proxy/policies/`, so a
regular install (`pip install .`, a wheel, a container image) can run `vllm-proxy demo`; the
checkout keeps one copy of them, at the top level. Compiles the routing decision's modules with
mypyc (proxy/native.py says which and why) unless `VLLM_PROXY_COMPILE=0` or mypyc is missing: the
package then runs as plain Python. Everything else is in pyproject.toml."""
import os
import runpy
import shutil
import sys
from pathlib import Path

from setuptools import setup
from setuptools.command.build_ext import build_ext
from setuptools.command.build_py import build_py

HERE = Path(__file__).resolve().parent


class BuildWithPolicies(build_py):
    def run(self) -> None:
        super().run()
        target = Path(self.build_lib) / "proxy" / "policies"
        target.mkdir(parents=True, exist_ok=True)
        for policy in sorted(HERE.joinpath("policies").glob("*.yaml")):
            shutil.copyfile(policy, target / policy.name)


NATIVE = runpy.run_path(str(HERE / "proxy" / "native.py"))  # (not importing the package)


def _record(root: Path, digests: "dict[str, str] | None") -> None:
    """Write (or, with None, remove) the record of what was compiled under `root`/proxy: an
    extension is imported only while the sources match it (proxy/native.py `stale`)."""
    path = root / "proxy" / NATIVE["RECORD"]
    if digests is None:
        path.unlink(missing_ok=True)
    elif path.parent.is_dir():
        path.write_text("# Written by setup.py: digests of the package's sources when it compiled the routing\n"
                        f"# modules (proxy/native.py).\nDIGESTS = {digests!r}\n")


class OptionalNative(build_ext):
    """The compiled modules are an optimisation: without a working C compiler the package is
    built as plain Python. The record of what was compiled is written only once every extension
    is built, beside them; a failure removes it and what was built."""

    def run(self) -> None:
        if not self.extensions:
            return
        roots = {HERE, Path(self.build_lib)}
        digests = NATIVE["digests"]()  # (before compiling: an edit meanwhile is then not trusted)
        try:
            super().run()
        except Exception as exc:  # (setuptools raises its own CompileError/LinkError classes)
            print(f"vllm-proxy: compiling the modules of proxy/native.py failed ({exc}); building plain Python",
                  file=sys.stderr)
            for ext in self.extensions:
                Path(self.get_ext_fullpath(ext.name)).unlink(missing_ok=True)
            for root in roots:
                _record(root, None)
            return
        # (the group library, built first: its folder holds the package)
        roots.add(Path(self.get_ext_fullpath(self.extensions[0].name)).parent)
        for root in roots:
            _record(root, digests)


def native_extensions() -> list:
    """mypycify's extensions, or none (plain Python): VLLM_PROXY_COMPILE=0, no mypyc, or mypy
    rejecting the sources (mypycify then exits: caught here)."""
    if os.environ.get("VLLM_PROXY_COMPILE", "1") == "0":
        _record(HERE, None)  # (extensions of an earlier in-place build are then not imported)
        return []
    try:
        from mypyc.build import mypycify
    except ImportError:
        print("vllm-proxy: mypyc is not installed; building plain Python", file=sys.stderr)
        _record(HERE, None)
        return []
    paths = [str(Path(*name.split(".")).with_suffix(".py")) for name in NATIVE["MODULES"]]
    try:
        # the build environment has mypy but not the project's dependencies: their types are Any
        return mypycify(["--ignore-missing-imports", "--follow-imports=silent", *paths],
                        opt_level="3", group_name=NATIVE["GROUP"])
    except (SystemExit, Exception) as exc:
        print(f"vllm-proxy: mypyc rejected the modules of proxy/native.py ({exc}); building plain Python", file=sys.stderr)
        _record(HERE, None)
        return []


setup(cmdclass={"build_py": BuildWithPolicies, "build_ext": OptionalNative}, ext_modules=native_extensions())
