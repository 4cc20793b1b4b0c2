"""Ships the example policies (`policies/*.yaml`) inside the package as `proxy/policies/`, so a
regular install (`pip install .`, a wheel, a container image) can run `vllm-proxy demo`; the
checkout keeps one copy of them, at the top level. Everything else is in pyproject.toml."""
import shutil
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py


class BuildWithPolicies(build_py):
    def run(self) -> None:
        super().run()
        target = Path(self.build_lib) / "proxy" / "policies"
        target.mkdir(parents=True, exist_ok=True)
        for policy in sorted(Path(__file__).resolve().parent.joinpath("policies").glob("*.yaml")):
            shutil.copyfile(policy, target / policy.name)


setup(cmdclass={"build_py": BuildWithPolicies})
