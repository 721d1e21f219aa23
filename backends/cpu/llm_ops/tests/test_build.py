"""build.sh and the Makefile: an incremental build that rebuilds exactly what changed."""

import ctypes
import os
import shutil
import subprocess
import sys
import tempfile
import time
import unittest

BACKEND_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, BACKEND_DIR)
import parity  # noqa: E402

SOURCES = ["errors.c", "rmsnorm.c", "silu_mul.c", "rope.c", "softmax.c"]
OBJECTS = [s[:-2] + ".o" for s in SOURCES]
SYMBOLS = ["llmops_abi_version", "llmops_error_string", "llmops_rmsnorm_f32",
           "llmops_silu_mul_f32", "llmops_rope_neox_f32", "llmops_softmax_f32"]


class IncrementalBuildTest(unittest.TestCase):
    """Builds a copy of the backend directory so that sources can be touched.

    The copy is built once for the class; each test starts from that build,
    copied back to the same place (the depfiles name objects by absolute
    path) with its mtimes."""

    @classmethod
    def setUpClass(cls):
        cls.tmp = tempfile.TemporaryDirectory(prefix="llmops-cpu-build-")
        cls.addClassCleanup(cls.tmp.cleanup)
        cls.work = os.path.join(cls.tmp.name, "work")
        cls.src = os.path.join(cls.work, "llm_ops")
        shutil.copytree(BACKEND_DIR, cls.src,
                        ignore=shutil.ignore_patterns("tests", "__pycache__"))
        cls.out = os.path.join(cls.work, "out")
        cls.obj = os.path.join(cls.out, "obj")
        result = cls.run_build()
        if result.returncode != 0:
            raise AssertionError("build.sh failed:\n" + result.stdout)
        cls.built = os.path.join(cls.tmp.name, "built")
        shutil.copytree(cls.work, cls.built, symlinks=True)

    def setUp(self):
        shutil.rmtree(self.work)
        shutil.copytree(self.built, self.work, symlinks=True)

    @classmethod
    def run_build(cls, *extra):
        return subprocess.run([os.path.join(cls.src, "build.sh"), cls.out] + list(extra),
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              universal_newlines=True)

    def build(self, *extra):
        result = self.run_build(*extra)
        self.assertEqual(result.returncode, 0, result.stdout)
        return result.stdout

    def settle(self):
        """Date sources before objects before now, whatever the clock resolution."""
        now = time.time()
        for name in os.listdir(self.src):
            os.utime(os.path.join(self.src, name), (now - 300, now - 300))
        for name in os.listdir(self.obj):
            os.utime(os.path.join(self.obj, name), (now - 200, now - 200))
        return {o: os.stat(os.path.join(self.obj, o)).st_mtime_ns for o in OBJECTS}

    def touch(self, name):
        now = time.time()
        os.utime(os.path.join(self.src, name), (now - 100, now - 100))

    def rebuilt(self, before):
        return sorted(o for o in OBJECTS
                      if os.stat(os.path.join(self.obj, o)).st_mtime_ns != before[o])

    def test_first_build_writes_one_object_per_source_and_the_library(self):
        self.assertEqual(sorted(n for n in os.listdir(self.obj) if n.endswith(".o")),
                         sorted(OBJECTS))
        dll = ctypes.CDLL(os.path.join(self.out, parity.LIBRARY_NAME))
        for symbol in SYMBOLS:
            self.assertTrue(hasattr(dll, symbol), symbol)

    def test_rebuild_with_nothing_changed_compiles_nothing(self):
        before = self.settle()
        output = self.build()
        self.assertEqual(self.rebuilt(before), [])
        self.assertNotIn(" -c ", output)

    def test_touching_one_source_recompiles_only_its_object(self):
        before = self.settle()
        self.touch("rope.c")
        output = self.build()
        self.assertEqual(self.rebuilt(before), ["rope.o"])
        self.assertEqual(output.count(" -c "), 1)

    def test_touching_ops_h_recompiles_every_object(self):
        before = self.settle()
        self.touch("ops.h")
        self.build()
        self.assertEqual(self.rebuilt(before), sorted(OBJECTS))

    def test_a_different_march_recompiles_every_object(self):
        before = self.settle()
        output = self.build("x86-64-v2")
        self.assertEqual(self.rebuilt(before), sorted(OBJECTS))
        self.assertEqual(output.count("-march=x86-64-v2"), len(SOURCES))


class BuildScriptTest(unittest.TestCase):
    def test_relative_output_dir_is_taken_from_the_callers_cwd(self):
        with tempfile.TemporaryDirectory(prefix="llmops-cpu-cwd-") as cwd:
            subprocess.run([os.path.join(BACKEND_DIR, "build.sh"), "rel/out"], cwd=cwd,
                           check=True, stdout=subprocess.DEVNULL)
            self.assertTrue(os.path.isfile(os.path.join(cwd, "rel", "out",
                                                        parity.LIBRARY_NAME)))

    def test_missing_output_dir_is_a_usage_error(self):
        result = subprocess.run([os.path.join(BACKEND_DIR, "build.sh")],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                universal_newlines=True)
        self.assertEqual(result.returncode, 2)
        self.assertIn("usage:", result.stderr)
        self.assertIn("<output-dir> [<march>]", result.stderr)


if __name__ == "__main__":
    unittest.main()
