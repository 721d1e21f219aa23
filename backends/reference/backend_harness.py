"""What the llm_ops parity scripts and tests share beside the reference itself:
building a backend with its build.sh and reading the tolerances its manifest
declares."""

import ctypes
import json
import os
import subprocess


class BuildError(Exception):
    """build.sh failed; the message carries its exit status and output."""


def build(backend_dir, library_name, out_dir, target=None):
    """Run <backend_dir>/build.sh <out_dir> [<target>]; return the library path."""
    command = [os.path.join(backend_dir, "build.sh"), out_dir] + ([target] if target else [])
    result = subprocess.run(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            universal_newlines=True)
    if result.returncode != 0:
        raise BuildError("build.sh exited with %d:\n%s" % (result.returncode, result.stdout))
    return os.path.join(out_dir, library_name)


def load_tolerances(manifest_path):
    """The manifest's numerics.tolerance without its note: op name -> tolerance."""
    with open(manifest_path) as f:
        tolerance = json.load(f)["numerics"]["tolerance"]
    return {op: tol for op, tol in tolerance.items() if op != "note"}


def load_library(path, signatures):
    """ctypes.CDLL(path) with restype and argtypes set from
    {name: (restype, argtypes)}."""
    dll = ctypes.CDLL(path)
    for name, (restype, argtypes) in signatures.items():
        function = getattr(dll, name)
        function.restype = restype
        function.argtypes = argtypes
    return dll
