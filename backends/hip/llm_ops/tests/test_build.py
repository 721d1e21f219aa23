"""build.sh with the real hipcc, and the library's host side: loads, ABI version, argument checks.

None of this needs a GPU: the HIP runtime loads without one (where it cannot
be loaded, the tests that call into the library skip and say why), and
arguments are checked before anything is launched.
"""

import json
import os
import shutil
import subprocess
import sys
import tempfile
import unittest

BACKEND_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(BACKEND_DIR)))
sys.path.insert(0, BACKEND_DIR)
sys.path.insert(0, ROOT)
import parity  # noqa: E402
import check_contract  # noqa: E402

HIPCC = os.environ.get("HIPCC") or shutil.which("hipcc")
SINGLE_ARCH = "gfx1030"
EXPORTS = sorted(parity.SIGNATURES)

builds = {}
build_dir = None


def setUpModule():
    global build_dir
    if not HIPCC:
        raise unittest.SkipTest("hipcc not found on PATH (set HIPCC, or install Debian's hipcc: "
                                "apt-get install --no-install-recommends hipcc; .ci/run does "
                                "where it runs as root)")
    build_dir = tempfile.TemporaryDirectory(prefix="llmops-hip-build-")
    # The fat library is built by the build tier, which the tests below hold
    # to its verdict; both builds at once: they share nothing.
    tier = [sys.executable, os.path.join(ROOT, "check_contract.py"), "--root", ROOT, "build",
            "hip/llm_ops", "--out", os.path.join(build_dir.name, "fat")]
    single = [os.path.join(BACKEND_DIR, "build.sh"), os.path.join(build_dir.name, "single"),
              SINGLE_ARCH]
    running = []
    for label, command, out_dir in (("fat", tier, "fat/hip/llm_ops"), ("single", single, "single")):
        log = tempfile.TemporaryFile("w+")
        running.append((label, command, log,
                        os.path.join(build_dir.name, out_dir, parity.LIBRARY_NAME),
                        subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT,
                                         # hipcc leaves an empty folder in $TMPDIR per compile
                                         env=dict(os.environ, GITHUB_ACTIONS="",
                                                  TMPDIR=build_dir.name))))
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


def load(test, label):
    """The built library through ctypes; the test skips, saying why, where
    the HIP runtime it links cannot be loaded."""
    result, path = builds[label]
    test.assertEqual(result.returncode, 0, result.stdout)
    try:
        return parity.Library(path)
    except OSError as error:
        test.skipTest("the library cannot be loaded here: %s" % error)


class BuildTest(unittest.TestCase):
    def test_default_build_is_clean_loads_and_reports_the_abi_version(self):
        result, _ = builds["fat"]
        self.assertNotIn("warning:", result.stdout.lower(), result.stdout)  # from hipcc
        self.assertEqual(load(self, "fat").dll.llmops_abi_version(), manifest()["abi_version"])

    def test_single_target_build_loads_and_reports_the_abi_version(self):
        self.assertEqual(load(self, "single").dll.llmops_abi_version(), manifest()["abi_version"])

    def test_single_target_build_is_smaller_than_the_fat_library(self):
        self.assertLess(os.path.getsize(builds["single"][1]), os.path.getsize(builds["fat"][1]))

    def test_only_the_llmops_abi_is_exported(self):
        self.assertEqual(builds["fat"][0].returncode, 0, builds["fat"][0].stdout)
        result = subprocess.run(["nm", "-D", "--defined-only", builds["fat"][1]],
                                stdout=subprocess.PIPE, universal_newlines=True, check=True)
        names = sorted(line.split()[-1] for line in result.stdout.splitlines() if line.strip())
        self.assertEqual(names, EXPORTS)

    def test_the_libraries_hold_code_objects_for_exactly_their_targets(self):
        for label, expected in (("fat", set(manifest()["build"]["architectures"])),
                                ("single", {SINGLE_ARCH})):
            with self.subTest(label=label):
                self.assertEqual(builds[label][0].returncode, 0, builds[label][0].stdout)
                library = check_contract.read_shared_object(builds[label][1])
                self.assertEqual(check_contract.hip_targets(library), expected)

    def test_the_bundle_reader_agrees_with_clang_offload_bundler(self):
        tool = clang_offload_bundler()
        if tool is None:
            self.skipTest("clang-offload-bundler is not installed (it comes with hipcc's clang)")
        for label in ("fat", "single"):
            with self.subTest(label=label):
                self.assertEqual(builds[label][0].returncode, 0, builds[label][0].stdout)
                library = check_contract.read_shared_object(builds[label][1])
                self.assertEqual(check_contract.hip_targets(library), listed_targets(library, tool))

    def test_the_build_tier_passes_and_names_the_gfx_targets(self):
        result, _ = builds["fat"]
        self.assertEqual(result.returncode, 0, result.stdout)
        self.assertRegex(result.stdout, r"\npassed hip/llm_ops: exports llmops_abi_version and "
                                        r"llmops_error_string; (llmops_abi_version\(\) = 1; )?"
                                        r"gfx targets gfx1030, gfx90a, gfx940 \(")

    def test_parity_script_skips_without_a_gpu_and_passes_with_one(self):
        hip, reason = parity.open_runtime()
        result = subprocess.run([sys.executable, os.path.join(BACKEND_DIR, "parity.py")],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                universal_newlines=True)
        self.assertEqual(result.returncode, 0, result.stdout + result.stderr)
        if hip is None:
            self.assertEqual(result.stdout, "SKIP: %s\n" % reason)
        else:
            self.assertEqual(result.stdout.splitlines()[-1], "0 failure(s)")

    def test_trace_agrees_with_the_code_objects_of_the_real_builds(self):
        # check_contract.py trace runs build.sh with a shim in place of hipcc; the
        # targets it reads from the recorded calls must be what hipcc put into the libraries.
        result = subprocess.run([sys.executable, os.path.join(ROOT, "check_contract.py"),
                                 "--repo-root", ROOT, "trace", "hip/llm_ops", "--arch",
                                 SINGLE_ARCH, "--format", "json"],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                universal_newlines=True)
        self.assertEqual(result.returncode, 0, result.stdout + result.stderr)
        fat_run, single_run = json.loads(result.stdout)["results"][0]["runs"]
        for label, run in (("fat", fat_run), ("single", single_run)):
            self.assertEqual(builds[label][0].returncode, 0, builds[label][0].stdout)
            library = check_contract.read_shared_object(builds[label][1])
            self.assertEqual((run["landed"], set(run["targets"])),
                             (parity.LIBRARY_NAME, check_contract.hip_targets(library)), label)

    def test_missing_output_dir_is_a_usage_error(self):
        result = subprocess.run([os.path.join(BACKEND_DIR, "build.sh")],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                universal_newlines=True)
        self.assertEqual(result.returncode, 2)
        self.assertIn("<output-dir> [<gfx-target>]", result.stderr)


def clang_offload_bundler():
    """clang's bundler, the independent reader of offload bundles, or None."""
    import glob
    found = shutil.which("clang-offload-bundler")
    return found or next(iter(sorted(glob.glob("/usr/lib/llvm-*/bin/clang-offload-bundler"),
                                     reverse=True)), None)


def listed_targets(library, tool):
    """The target ids clang-offload-bundler --list gives for each bundle of .hip_fatbin."""
    offset, size = library.sections[".hip_fatbin"]
    section = library.data[offset:offset + size]
    magic = check_contract.BUNDLE_MAGIC
    targets = set()
    with tempfile.TemporaryDirectory(prefix="llmops-hip-bundles-") as scratch:
        start = section.find(magic)
        while start != -1:
            end = section.find(magic, start + 1)
            path = os.path.join(scratch, "%d.bundle" % start)
            with open(path, "wb") as handle:
                handle.write(section[start:end if end != -1 else len(section)])
            listed = subprocess.run([tool, "--list", "--type=o", "--input=" + path],
                                    stdout=subprocess.PIPE, universal_newlines=True,
                                    check=True).stdout
            targets.update(line.split("--", 1)[1] for line in listed.split()
                           if not line.startswith("host-"))
            start = end
    return targets


class HostSideTest(unittest.TestCase):
    """Codes from llm_ops.h; bad arguments are refused before any launch."""

    NULL, SIZE, INVALID, LAUNCH = 1000, 1001, 1002, 1003
    FAKE = 0x1000  # never dereferenced: every call below fails its checks first

    def setUp(self):
        self.lib = load(self, "fat")

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
        hip, reason = parity.open_runtime()
        if hip is not None:
            self.skipTest("an AMD GPU is present: launching on fake pointers would fault it")
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
            "the HIP kernel launch failed"))
        for code in (-1, 1, 999, 1004):
            self.assertEqual(self.lib.error_string(code), "unknown llmops error code")


if __name__ == "__main__":
    unittest.main()
