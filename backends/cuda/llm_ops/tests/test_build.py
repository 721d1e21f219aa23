"""build.sh with the real nvcc, and the library's host side: loads, ABI version, argument checks.

None of this needs a GPU: the CUDA runtime is linked statically and loads
without a driver, and arguments are checked before anything is launched.
"""

import json
import os
import shutil
import subprocess
import sys
import tempfile
import unittest

BACKEND_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, BACKEND_DIR)
import parity  # noqa: E402

NVCC = os.environ.get("NVCC") or shutil.which("nvcc")
SINGLE_ARCH = "89"
EXPORTS = sorted(parity.SIGNATURES)

builds = {}
build_dir = None


def setUpModule():
    global build_dir
    if not NVCC:
        raise unittest.SkipTest("nvcc not found on PATH (set NVCC to build the CUDA backend)")
    build_dir = tempfile.TemporaryDirectory(prefix="llmops-cuda-build-")
    running = []  # both builds at once: they share nothing
    for label, arch in (("fat", None), ("single", SINGLE_ARCH)):
        out_dir = os.path.join(build_dir.name, label)
        command = [os.path.join(BACKEND_DIR, "build.sh"), out_dir] + ([arch] if arch else [])
        log = tempfile.TemporaryFile("w+")
        running.append((label, command, log, os.path.join(out_dir, parity.LIBRARY_NAME),
                        subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)))
    for label, command, log, library, build in running:
        with log:
            returncode = build.wait()
            log.seek(0)
            builds[label] = (subprocess.CompletedProcess(command, returncode, log.read()), library)


def tearDownModule():
    if build_dir is not None:
        build_dir.cleanup()


def manifest():
    with open(parity.MANIFEST) as f:
        return json.load(f)


class BuildTest(unittest.TestCase):
    def check_build(self, label):
        result, path = builds[label]
        self.assertEqual(result.returncode, 0, result.stdout)
        self.assertNotIn("warning", result.stdout.lower(), result.stdout)
        lib = parity.Library(path)
        self.assertEqual(lib.dll.llmops_abi_version(), manifest()["abi_version"])
        return lib

    def test_default_build_is_clean_loads_and_reports_the_abi_version(self):
        self.check_build("fat")

    def test_single_architecture_build_loads_and_reports_the_abi_version(self):
        self.check_build("single")

    def test_single_architecture_build_is_smaller_than_the_fat_library(self):
        self.assertLess(os.path.getsize(builds["single"][1]), os.path.getsize(builds["fat"][1]))

    def test_only_the_llmops_abi_is_exported(self):
        result = subprocess.run(["nm", "-D", "--defined-only", builds["fat"][1]],
                                stdout=subprocess.PIPE, universal_newlines=True, check=True)
        names = sorted(line.split()[-1] for line in result.stdout.splitlines() if line.strip())
        self.assertEqual(names, EXPORTS)

    def test_parity_script_skips_without_a_gpu_and_passes_with_one(self):
        cuda, reason = parity.open_driver()
        result = subprocess.run([sys.executable, os.path.join(BACKEND_DIR, "parity.py")],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                universal_newlines=True)
        self.assertEqual(result.returncode, 0, result.stdout + result.stderr)
        if cuda is None:
            self.assertEqual(result.stdout, "SKIP: %s\n" % reason)
        else:
            self.assertEqual(result.stdout.splitlines()[-1], "0 failure(s)")

    def test_trace_agrees_with_the_fatbinaries_of_the_real_builds(self):
        # check_contract.py trace runs build.sh with a shim in place of nvcc; what it reads
        # from the recorded nvcc calls must be what the real nvcc put into the libraries.
        root = os.path.dirname(os.path.dirname(os.path.dirname(BACKEND_DIR)))
        sys.path.insert(0, root)
        import check_contract
        result = subprocess.run([sys.executable, os.path.join(root, "check_contract.py"),
                                 "--repo-root", root, "trace", "cuda/llm_ops", "--arch",
                                 SINGLE_ARCH, "--format", "json"],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                universal_newlines=True)
        self.assertEqual(result.returncode, 0, result.stdout + result.stderr)
        fat_run, single_run = json.loads(result.stdout)["results"][0]["runs"]
        for label, run in (("fat", fat_run), ("single", single_run)):
            self.assertEqual(builds[label][0].returncode, 0, builds[label][0].stdout)
            sass, ptx, sealed = check_contract.cuda_targets(check_contract.read_shared_object(builds[label][1]))
            self.assertEqual((run["landed"], set(run["targets"]), set(run["ptx"])),
                             (parity.LIBRARY_NAME, sass, ptx), label)
            self.assertEqual(sealed, set(), label)
        self.assertEqual(set(fat_run["targets"]), {str(a) for a in manifest()["build"]["architectures"]})

    def test_missing_output_dir_is_a_usage_error(self):
        result = subprocess.run([os.path.join(BACKEND_DIR, "build.sh")],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                universal_newlines=True)
        self.assertEqual(result.returncode, 2)
        self.assertIn("<output-dir> [<compute-capability>]", result.stderr)


class HostSideTest(unittest.TestCase):
    """Codes from llm_ops.h; bad arguments are refused before any launch."""

    NULL, SIZE, INVALID, LAUNCH = 1000, 1001, 1002, 1003
    FAKE = 0x1000  # never dereferenced: every call below fails its checks first

    @classmethod
    def setUpClass(cls):
        result, path = builds["fat"]
        if result.returncode != 0:
            raise unittest.SkipTest("the default build failed (see BuildTest)")
        cls.lib = parity.Library(path)

    def call(self, name, *args):
        return getattr(self.lib.dll, name)(*args)

    def test_null_pointers_return_the_null_pointer_code(self):
        f = self.FAKE
        for dtype in parity.DTYPES:
            with self.subTest(dtype=dtype):
                rms, silu = "llmops_rmsnorm_" + dtype, "llmops_silu_mul_" + dtype
                rope, soft = "llmops_rope_neox_" + dtype, "llmops_softmax_" + dtype
                for args in ((None, f, f), (f, None, f), (f, f, None)):
                    self.assertEqual(self.call(rms, *args, 1, 4, 1e-6, None), self.NULL)
                self.assertEqual(self.call(silu, None, f, 1, 4, None), self.NULL)
                self.assertEqual(self.call(silu, f, None, 1, 4, None), self.NULL)
                self.assertEqual(self.call(soft, None, f, 1, 4, None), self.NULL)
                self.assertEqual(self.call(soft, f, None, 1, 4, None), self.NULL)
                for i in range(4):
                    pointers = [f] * 4
                    pointers[i] = None
                    self.assertEqual(self.call(rope, *pointers, 2, 2, 1, 8, 8, 4, None),
                                     self.NULL)

    def test_zero_and_negative_sizes_return_the_size_code(self):
        f = self.FAKE
        for dtype in parity.DTYPES:
            for rows, cols in ((0, 4), (4, 0), (-1, 4), (4, -2147483648)):
                with self.subTest(dtype=dtype, rows=rows, cols=cols):
                    self.assertEqual(self.call("llmops_rmsnorm_" + dtype, f, f, f, rows, cols,
                                               1e-6, None), self.SIZE)
                    self.assertEqual(self.call("llmops_silu_mul_" + dtype, f, f, rows, cols,
                                               None), self.SIZE)
                    self.assertEqual(self.call("llmops_softmax_" + dtype, f, f, rows, cols,
                                               None), self.SIZE)
            for i in range(6):
                sizes = [2, 2, 1, 8, 8, 4]
                sizes[i] = 0
                self.assertEqual(self.call("llmops_rope_neox_" + dtype, f, f, f, f, *sizes,
                                           None), self.SIZE)

    def test_out_of_range_values_return_the_invalid_argument_code(self):
        f = self.FAKE
        for dtype in parity.DTYPES:
            with self.subTest(dtype=dtype):
                for eps in (-1.0, float("nan"), float("inf")):
                    self.assertEqual(self.call("llmops_rmsnorm_" + dtype, f, f, f, 1, 4, eps,
                                               None), self.INVALID)
                rope = "llmops_rope_neox_" + dtype
                self.assertEqual(self.call(rope, f, f, f, f, 2, 2, 1, 8, 7, 4, None),
                                 self.INVALID)
                self.assertEqual(self.call(rope, f, f, f, f, 2, 2, 1, 8, 10, 4, None),
                                 self.INVALID)

    def test_a_launch_without_a_gpu_returns_the_launch_error_code(self):
        cuda, reason = parity.open_driver()
        if cuda is not None:
            self.skipTest("a GPU is present: launching on fake pointers would fault it")
        f = self.FAKE
        self.assertEqual(self.call("llmops_rmsnorm_f32", f, f, f, 1, 4, 1e-6, None),
                         self.LAUNCH)
        self.assertEqual(self.call("llmops_softmax_bf16", f, f, 1, 4, None), self.LAUNCH)

    def test_error_strings_explain_every_code(self):
        self.assertEqual(self.lib.error_string(0), "success")
        self.assertEqual(self.lib.error_string(self.NULL), "a required pointer argument is NULL")
        self.assertEqual(self.lib.error_string(self.SIZE), "a size argument is zero or negative")
        self.assertEqual(self.lib.error_string(self.INVALID),
                         "an argument is outside its documented range (see llm_ops.h)")
        self.assertTrue(self.lib.error_string(self.LAUNCH).startswith(
            "the CUDA kernel launch failed"))
        for code in (-1, 1, 999, 1004):
            self.assertEqual(self.lib.error_string(code), "unknown llmops error code")


if __name__ == "__main__":
    unittest.main()
