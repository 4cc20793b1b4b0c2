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
BUILT = HERE / "proxy" / "native_built.py"


class BuildWithPolicies(build_py):
    def run(self) -> None:
        super().run()
        target = Path(self.build_lib) / "proxy" / "policies"
        target.mkdir(parents=True, exist_ok=True)
        for policy in sorted(HERE.joinpath("policies").glob("*.yaml")):
            shutil.copyfile(policy, target / policy.name)


class OptionalNative(build_ext):
    """The compiled modules are an optimisation: without a working C compiler the package is
    built as plain Python (proxy/native.py imports the sources when the group library is missing)."""

    def run(self) -> None:
        try:
            super().run()
        except Exception as exc:  # (setuptools raises its own CompileError/LinkError classes)
            print(f"vllm-proxy: compiling the routing modules failed ({exc}); building plain Python",
                  file=sys.stderr)
            BUILT.unlink(missing_ok=True)  # (extensions of an earlier build are then not trusted)


def native_extensions() -> list:
    if os.environ.get("VLLM_PROXY_COMPILE", "1") == "0":
        return []
    try:
        from mypyc.build import mypycify
    except ImportError:
        print("vllm-proxy: mypyc is not installed; building plain Python", file=sys.stderr)
        return []
    native = runpy.run_path(str(HERE / "proxy" / "native.py"))  # (not importing the package)
    paths = [str(Path(*name.split(".")).with_suffix(".py")) for name in native["MODULES"]]
    # what is compiled, by digest: an extension whose source differs from it is not imported
    BUILT.write_text("# Written by setup.py: digests of the sources it compiled (proxy/native.py).\n"
                     f"DIGESTS = {native['digests']()!r}\n")
    # the build environment has mypy but not the project's dependencies: their types are Any
    return mypycify(["--ignore-missing-imports", "--follow-imports=silent", *paths],
                    opt_level="3", group_name=native["GROUP"])


setup(cmdclass={"build_py": BuildWithPolicies, "build_ext": OptionalNative}, ext_modules=native_extensions())
