"""``dgpo_ops.__version__``: the installed distribution's version, or "0+unknown" in a checkout that is not
installed (the library reads no file of the checkout, its pyproject.toml included)."""

from __future__ import annotations

import importlib.metadata
import pathlib
import subprocess
import sys

import dgpo_ops

REPO = pathlib.Path(__file__).resolve().parents[2]

# dgpo_ops imported from the checkout with no installed distribution to be found
NOT_INSTALLED = """
import importlib.metadata as metadata

def version(name):
    raise metadata.PackageNotFoundError(name)

metadata.version = version
import dgpo_ops
print(dgpo_ops.__file__)
print(dgpo_ops.__version__)
"""


def test_version_is_the_installed_distributions():
    assert dgpo_ops.__version__ == importlib.metadata.version("dgpo-ops")


def test_a_checkout_that_is_not_installed_has_an_unknown_version():
    result = subprocess.run([sys.executable, "-c", NOT_INSTALLED], cwd=REPO, capture_output=True, text=True,
                            check=True, timeout=300)
    package, version = result.stdout.splitlines()
    assert pathlib.Path(package).parent.parent == REPO
    assert version == "0+unknown"
