"""Tests of check_contract.py: every rule passing and failing, the command line,
robustness against broken input, and agreement with backends/backend.schema.json.

Fixture trees are built from {path: content} dicts in temporary directories;
the checker runs in-process through main([...]).
"""

import argparse
import ast
import contextlib
import copy
import fnmatch
import glob
import io
import json
import os
import posixpath
import random
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import unittest
from unittest import mock

import check_contract
import overlay_setup

HERE = os.path.dirname(os.path.abspath(__file__))
CHECKER = os.path.join(HERE, "check_contract.py")
SCHEMA_PATH = os.path.join(HERE, "backends", "backend.schema.json")

# The tests that send SIGINT expect what a terminal gives: a run started in the
# background by a non-interactive shell (nohup CMD &) inherits SIGINT ignored,
# and so would every tool these tests start.
if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)


class Executable(str):
    """File content to be written with mode 0755."""


CPU_BUILD = Executable("""#!/usr/bin/env bash
# Build the demo library: ./build.sh <out-dir> [<march>]
set -euo pipefail
out_dir=$1
march=${2:-x86-64}
here="$(cd "$(dirname "$0")" && pwd)"
mkdir -p "$out_dir"
cc -O2 -shared -fPIC -march="$march" "$here/ops.c" \\
   -o "$out_dir/libdemo.so"
""")

CUDA_FAT_BUILD = Executable("""#!/usr/bin/env bash
set -euo pipefail
out_dir="$1"
mkdir -p "$out_dir"
if [ $# -ge 2 ]; then
  targets=(-gencode "arch=compute_$2,code=sm_$2")
else
  targets=(-gencode arch=compute_80,code=sm_80
           -gencode arch=compute_89,code=sm_89   # Ada
           -gencode "arch=compute_90,code=[sm_90,compute_90]")
fi
"${NVCC:-nvcc}" -O3 -shared -Xcompiler -fPIC "${targets[@]}" -o "$out_dir/libfat.so" ops.cu
""")

OPS_H = """#ifndef DEMO_OPS_H
#define DEMO_OPS_H
#include <stdint.h>
#define DEMO_ABI_VERSION 1
uint32_t demo_abi_version(void);
const char* demo_error_string(int code);
#endif
"""


def demo_manifest(**changes):
    manifest = {
        "$schema": "../../backend.schema.json",
        "name": "demo",
        "platform": "cpu",
        "abi_version": 1,
        "status": "validated",
        "sources": ["ops.h", "ops.c"],
        "build": {"script": "build.sh", "output": "libdemo.so",
                  "architectures": ["x86-64"], "default_arch": "x86-64"},
        "numerics": {"precision": "fp32", "accumulation": "fp32",
                     "tolerance": {"rmsnorm_f32": 1e-5, "note": "|out - ref| <= tol * max(1, |ref|)"}},
        "reference": {"entrypoint": "backends/cpu/demo/parity.py"},
    }
    manifest.update(changes)
    return manifest


def demo_files(manifest=None, **extra):
    files = {
        "backends/cpu/demo/demo.backend.json": demo_manifest() if manifest is None else manifest,
        "backends/cpu/demo/ops.h": OPS_H,
        "backends/cpu/demo/ops.c": '#include "ops.h"\nuint32_t demo_abi_version(void) { return DEMO_ABI_VERSION; }\n',
        "backends/cpu/demo/build.sh": CPU_BUILD,
        "backends/cpu/demo/parity.py": "print('ok')\n",
    }
    files.update(extra)
    return files


def fat_files(**changes):
    manifest = {"name": "fat", "platform": "cuda", "abi_version": 2, "status": "experimental",
                "sources": ["fat.cuh", "ops.cu"],
                "build": {"script": "build.sh", "output": "libfat.so",
                          "architectures": [80, 89, 90], "default_arch": 90, "min_capability": 80}}
    manifest["build"].update(changes)
    return {
        "backends/cuda/fat/fat.backend.json": manifest,
        "backends/cuda/fat/fat.cuh": "#define FAT_ABI_VERSION 2\nunsigned fat_abi_version(void);\n"
                                     "const char* fat_error_string(int code);\n",
        "backends/cuda/fat/ops.cu": '#include "fat.cuh"\n',
        "backends/cuda/fat/build.sh": CUDA_FAT_BUILD,
    }


def write_tree(root, files):
    for path, content in files.items():
        full = os.path.join(root, path)
        os.makedirs(os.path.dirname(full), exist_ok=True)
        if isinstance(content, (dict, list)):
            content = json.dumps(content, indent=2)
        mode = "wb" if isinstance(content, bytes) else "w"
        with open(full, mode) as handle:
            handle.write(content)
        if isinstance(content, Executable):
            os.chmod(full, 0o755)


def run_main(argv, env=None):
    out, err = io.StringIO(), io.StringIO()
    saved = dict(os.environ)
    os.environ.pop("GITHUB_ACTIONS", None)
    os.environ.update(env or {})
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            rc = check_contract.main(argv)
    finally:
        os.environ.clear()
        os.environ.update(saved)
    assert_no_temporary_path(out.getvalue() + err.getvalue())
    return rc, out.getvalue(), err.getvalue()


def assert_no_temporary_path(text):
    """Every path the checker shows is one the user can find: the
    repository's, <output-dir>, <toolkit>, never one in the trace's own
    temporary directory, which is gone when the command ends."""
    for word in ("check-contract-trace-", "<tmp>"):
        assert word not in text, "a temporary path (%s) in: %s" % (word, text)


def terminal_env(**extra):
    """The environment, as in a terminal: without GITHUB_ACTIONS, under which
    the checker prints annotations instead of the text the tests expect."""
    env = dict(os.environ, **extra)
    env.pop("GITHUB_ACTIONS", None)
    return env


class TreeTest(unittest.TestCase):
    def setUp(self):
        self.root = tempfile.mkdtemp(prefix="check-contract-")
        self.addCleanup(shutil.rmtree, self.root, True)

    def tree(self, files):
        write_tree(self.root, files)

    def path(self, rel):
        return os.path.join(self.root, rel)

    def check(self, *args, env=None):
        return run_main(["--repo-root", self.root] + list(args), env=env)

    def issues(self, *names):
        rc, out, err = self.check("--format", "json", *names)
        self.assertEqual(err, "")
        return rc, json.loads(out)["issues"]

    def codes(self, *names):
        return sorted(i["code"] for i in self.issues(*names)[1])

    def assertIssue(self, code, message, level="error"):
        rc, issues = self.issues()
        found = [(i["level"], i["code"], i["message"]) for i in issues]
        self.assertIn((level, code, message), found)
        return issues

    def assertClean(self):
        rc, out, err = self.check()
        self.assertEqual((rc, err), (0, ""), out)
        self.assertTrue(out.endswith(" 0 error(s), 0 warning(s)\n"), out)


class DiscoveryTest(TreeTest):
    def test_valid_backend_passes(self):
        self.tree(demo_files())
        rc, out, err = self.check()
        self.assertEqual((rc, out, err), (0, "checked cpu/demo: status=validated abi=1\n"
                                             "1 backend(s), 0 error(s), 0 warning(s)\n", ""))

    def test_missing_backends_dir_is_a_usage_error_that_names_it(self):
        self.tree({"README.md": "x\n"})
        self.assertEqual(self.check(), (2, "", "check_contract.py: error: no backends directory: "
                                              "%s/backends is not there (the root is %s, given by "
                                              "--root); give --root DIR (the directory that "
                                              "holds backends/) or --backends-dir DIR, or run from "
                                              "inside the repository\n" % (self.root, self.root)))

    def test_empty_backends_dir_is_a_warning(self):
        self.tree({"backends/README.md": "x\n"})
        self.assertEqual(self.check(), (0, "backends: [warning] D007 backends: the backends directory "
                                           "backends holds no backend; nothing was checked (a backend is "
                                           "backends/<platform>/<name>/<name>.backend.json)\n"
                                           "0 backend(s), 0 error(s), 1 warning(s)\n", ""))
        self.assertEqual(self.check("--strict")[0], 1)

    def test_undeclared_kernel_dir_is_an_error(self):
        self.tree({"backends/cuda/qwen3_5/" + name: "" for name in
                   ("elementwise.cu", "attention.cu", "kernels/zz.cu", "common.cuh")})
        rc, out, err = self.check()
        self.assertEqual(rc, 1)
        self.assertEqual(out, "backends/cuda/qwen3_5: [error] D001 cuda/qwen3_5: has kernel sources "
                              "(attention.cu, common.cuh, "
                              "elementwise.cu) but no qwen3_5.backend.json manifest; run: python3 "
                              "check_contract.py init backends/cuda/qwen3_5\n"
                              "0 backend(s), 1 error(s), 0 warning(s)\n")

    def test_dir_without_kernel_sources_is_ignored(self):
        self.tree(demo_files(**{"backends/cuda/notes/README.md": "x", "backends/reference/ref.py": "x"}))
        self.assertClean()

    def test_manifest_under_wrong_name_is_never_discovered(self):
        self.tree({"backends/cpu/demo/manifest.backend.json": demo_manifest(),
                   "backends/cpu/demo/ops.c": ""})
        self.assertIssue("D002", "manifest manifest.backend.json is never discovered: the manifest "
                         "of directory demo must be named demo.backend.json")

    def test_likely_manifest_names_are_never_discovered_either(self):
        self.tree({"backends/cpu/demo/backend.json": demo_manifest(), "backends/cpu/demo/ops.c": "",
                   "backends/cpu/demo/demo.json": demo_manifest(), "backends/cpu/demo/config.json": "{}"})
        rc, issues = self.issues()
        self.assertEqual([(i["code"], i["message"]) for i in issues], [
            ("D002", "manifest %s is never discovered: the manifest of directory demo must be named "
             "demo.backend.json" % name) for name in ("backend.json", "demo.json")])

    def test_unknown_platform_gets_a_warning_and_the_independent_checks(self):
        files = {p.replace("backends/cpu/", "backends/metal/"): c for p, c in demo_files().items()}
        files["backends/metal/demo/demo.backend.json"] = demo_manifest(platform="metal")
        files["backends/metal/demo/extra.c"] = ""
        self.tree(files)
        rc, issues = self.issues()
        self.assertEqual([(i["level"], i["code"], i["message"]) for i in issues], [
            ("warning", "D003", 'unknown platform directory "metal"; only platform-independent '
             "checks run (known platforms: cpu, cuda, hip)"),
            ("error", "T002", 'reference.entrypoint "backends/cpu/demo/parity.py" does not exist '
             "(it is relative to the repository root)"),
            ("error", "S004", "kernel source extra.c is not declared in sources; add it, or list it "
             "in excluded if it is not part of the library")])

    def test_backends_dir_option(self):
        files = {p.replace("backends/", "src/backends/"): c for p, c in demo_files().items()}
        files["src/backends/cpu/demo/demo.backend.json"] = demo_manifest(
            reference={"entrypoint": "src/backends/cpu/demo/parity.py"})
        self.tree(files)
        rc, out, err = self.check("--backends-dir", "src/backends")
        self.assertEqual((rc, err), (0, ""))
        self.assertIn("checked cpu/demo: status=validated abi=1\n", out)
        self.assertEqual(self.check(), (2, "", "check_contract.py: error: no backends directory: "
                                       "%s/backends is not there (the root is %s, given by --root); "
                                       "give --root DIR (the directory that holds backends/) or "
                                       "--backends-dir DIR, or run from inside the repository\n"
                                       % (self.root, self.root)))

    def test_backends_dir_that_is_not_there_is_a_usage_error(self):
        self.tree(demo_files(**{"README.md": "x\n"}))
        for given, problem in (("typo", "no backends directory: %s/typo is not there" % self.root),
                               ("README.md", "no backends directory: %s/README.md is not a directory"
                                % self.root),
                               ("/etc", "--backends-dir /etc: give a directory relative to the "
                                "repository root"),
                               ("../backends", "--backends-dir ../backends: give a directory relative "
                                "to the repository root")):
            with self.subTest(given=given):
                rc, out, err = self.check("--backends-dir", given)
                self.assertEqual((rc, out), (2, ""))
                self.assertIn(problem, err)

    def test_directory_that_cannot_be_listed_is_an_error(self):
        real_scandir = os.scandir
        for rel, key in (("backends", "backends"), ("backends/cpu", "cpu"),
                         ("backends/cpu/demo", "cpu/demo"), ("backends/cpu/demo/sub", "cpu/demo")):
            with self.subTest(rel=rel):
                self.tree(demo_files(**{"backends/cpu/demo/sub/x.txt": ""}))
                blocked = self.path(rel)

                def scandir(path="."):
                    if os.fspath(path).rstrip("/") == blocked:
                        raise PermissionError(13, "Permission denied", path)
                    return real_scandir(path)
                with mock.patch("os.scandir", scandir):
                    rc, out, err = self.check()
                self.assertEqual(rc, 1)
                self.assertIn("%s: [error] D004 %s: cannot list directory %s: Permission denied; the "
                              "check cannot see what it holds" % (rel, key, rel), out)


class FlatLayoutTest(TreeTest):
    """A manifest directly in its platform directory (backends/cuda/laya.backend.json)
    whose sources are beside it and in directories of their own: a backend
    that owns those directories; a sibling directory it does not name is
    still a backend of its own, or D001."""

    def flat(self, **changes):
        manifest = {"name": "laya", "platform": "cuda", "abi_version": 3, "status": "validated",
                    "sources": ["ops.h", "kernels/attn.cu", "kernels/norm.cu"],
                    "build": {"script": "build.sh", "output": "liblaya.so", "architectures": [90]},
                    "numerics": {"precision": "bf16", "accumulation": "fp32", "tolerance": {"attn": 0.01}},
                    "reference": {"entrypoint": "backends/reference/laya_ref.py"}}
        manifest.update(changes)
        files = {"backends/cuda/laya.backend.json": manifest,
                 "backends/cuda/ops.h": "#define LAYA_ABI_VERSION 3\nunsigned laya_abi_version(void);\n"
                                        "const char* laya_error_string(int code);\n",
                 "backends/cuda/kernels/attn.cu": '#include "../ops.h"\n',
                 "backends/cuda/kernels/norm.cu": '#include "../ops.h"\n',
                 "backends/cuda/build.sh": Executable(
                     '#!/usr/bin/env bash\nset -euo pipefail\ncd "$(dirname "$0")"\nmkdir -p "$1"\n'
                     'nvcc -shared -Xcompiler -fPIC -gencode arch=compute_90,code=sm_90 kernels/*.cu '
                     '-o "$1/liblaya.so"\n'),
                 "backends/reference/laya_ref.py": "print('ok')\n"}
        self.tree(files)

    def test_a_flat_backend_is_discovered_and_its_own_directories_are_not_reported(self):
        self.flat()
        rc, out, err = self.check()
        self.assertEqual((rc, out, err), (0, "checked cuda/laya: status=validated abi=3\n"
                                              "1 backend(s), 0 error(s), 0 warning(s)\n", ""))
        self.assertEqual(self.check("list")[1], "cuda/laya platform=cuda status=validated\n")

    def test_its_sources_are_resolved_against_the_platform_directory(self):
        self.flat(sources=["ops.h", "kernels/attn.cu", "kernels/norm.cu", "kernels/rope.cu"])
        self.assertIssue("S001", "source kernels/rope.cu does not exist")
        rc, issues = self.issues()
        self.assertEqual([(i["code"], i["path"]) for i in issues], [("S001", "backends/cuda/kernels/rope.cu")])
        self.flat(sources=["ops.h", "kernels/attn.cu"])
        self.assertIssue("S004", "kernel source kernels/norm.cu is not declared in sources; add it, "
                         "or list it in excluded if it is not part of the library")

    def test_a_validated_flat_backend_finds_its_reference(self):
        self.flat()
        rc, out, err = self.check("parity")
        self.assertEqual(rc, 0, out + err)
        self.flat(reference={"entrypoint": "backends/reference/missing.py"})
        self.assertIssue("T002", 'reference.entrypoint "backends/reference/missing.py" does not exist '
                         "(it is relative to the repository root)")

    def test_an_undeclared_sibling_backend_is_still_reported(self):
        self.flat()
        self.tree({"backends/cuda/other/x.cu": "", "backends/cuda/stray.cu": ""})
        rc, issues = self.issues()
        self.assertEqual([(i["code"], i["backend"], i["path"]) for i in issues], [
            ("S004", "cuda/laya", "backends/cuda/stray.cu"),
            ("D001", "cuda/other", "backends/cuda/other")])


class DiscoveryHolesTest(TreeTest):
    """What discovery once missed, or misnamed."""

    def test_a_hidden_directory_in_a_platform_directory_is_seen(self):
        self.tree(demo_files(**{"backends/cpu/.wip/wip.c": "int wip(void) { return 1; }\n"}))
        self.assertIssue("D001", "is a hidden directory with kernel sources (wip.c) that no manifest "
                         "declares, which a build can still compile; move them into a backend "
                         "directory, or out of the backends directory")

    def test_a_platform_level_tests_directory_is_no_backend(self):
        self.tree(demo_files(**{"backends/cpu/tests/fixture.c": "int main(void) { return 0; }\n",
                                "backends/cpu/test/lib.rs": "#[test] fn t() {}\n",
                                "backends/cpu/test/fixture.h": "\n"}))
        self.assertClean()

    def test_a_manifest_in_an_unsupported_place_is_named_with_the_layout(self):
        manifest = dict(demo_manifest(), name="foo")
        self.tree({"backends/cpu/group/foo/foo.backend.json": manifest,
                   "backends/cpu/group/foo/ops.c": "", "backends/cpu/group.backend.json": manifest})
        rc, issues = self.issues()
        self.assertEqual([(i["code"], i["path"], i["message"]) for i in issues], [
            ("D002", "backends/cpu/group.backend.json", "manifest group.backend.json is never discovered: "
             "a backend is a directory backends/cpu/<name>/ holding <name>.backend.json; move it to "
             "backends/cpu/group/group.backend.json"),
            ("D002", "backends/cpu/group/foo/foo.backend.json", "manifest foo/foo.backend.json is never "
             "discovered: a backend is a directory backends/cpu/<name>/ holding <name>.backend.json; "
             "move backends/cpu/group/foo/ there")])

    def test_a_build_script_or_manifest_linked_out_of_the_repository_is_s002(self):
        outside = tempfile.mkdtemp(prefix="check-contract-outside-")
        self.addCleanup(shutil.rmtree, outside, True)
        files = demo_files()
        with open(os.path.join(outside, "build.sh"), "w") as handle:
            handle.write(str(files.pop("backends/cpu/demo/build.sh")))
        os.chmod(os.path.join(outside, "build.sh"), 0o755)
        self.tree(files)
        os.symlink(os.path.join(outside, "build.sh"), self.path("backends/cpu/demo/build.sh"))
        self.assertIssue("S002", "build script build.sh is a symbolic link to %s/build.sh, outside "
                         "the repository; keep it in the repository, where CI and the trace run it"
                         % os.path.realpath(outside))
        os.replace(self.path("backends/cpu/demo/demo.backend.json"), os.path.join(outside, "m.json"))
        os.symlink(os.path.join(outside, "m.json"), self.path("backends/cpu/demo/demo.backend.json"))
        self.assertIssue("S002", "demo.backend.json is a symbolic link to %s/m.json, outside the "
                         "repository; the check does not follow it (replace the link with the file "
                         "it stands for)" % os.path.realpath(outside))

    def test_init_declares_a_source_linked_inside_the_directory(self):
        self.tree({"backends/cpu/demo/include/ops_impl.h": OPS_H,
                   "backends/cpu/demo/ops.c": '#include "ops.h"\n',
                   "backends/cpu/demo/build.sh": CPU_BUILD})
        os.symlink("include/ops_impl.h", self.path("backends/cpu/demo/ops.h"))
        rc, out, err = run_main(["--repo-root", self.root, "init", "--no-trace",
                                 self.path("backends/cpu/demo")])
        self.assertEqual((rc, err), (0, ""), out)
        with open(self.path("backends/cpu/demo/demo.backend.json")) as handle:
            self.assertEqual(json.load(handle)["sources"], ["include/ops_impl.h", "ops.c", "ops.h"])
        self.assertClean()


class ManifestFileTest(TreeTest):
    def test_invalid_json_gives_line_and_column(self):
        self.tree(demo_files(**{"backends/cpu/demo/demo.backend.json": '{\n  "name": "demo"\n  "x": 1\n}'}))
        issues = self.assertIssue("J001", "invalid JSON at line 3, column 3: Expecting ',' delimiter")
        self.assertEqual(issues[0]["line"], 3)
        self.assertEqual(issues[0]["path"], "backends/cpu/demo/demo.backend.json")

    def test_byte_order_mark_is_named(self):
        text = "\ufeff" + json.dumps(demo_manifest())
        self.tree(demo_files(**{"backends/cpu/demo/demo.backend.json": text.encode("utf-8")}))
        self.assertIssue("J001", "demo.backend.json starts with a byte-order mark, which JSON does "
                         "not allow; save it as UTF-8 without one")

    @unittest.skipUnless(hasattr(sys, "get_int_max_str_digits"), "this Python reads any number")
    def test_number_too_long_to_read_is_named(self):
        text = json.dumps(demo_manifest()).replace('"abi_version": 1', '"abi_version": 1' + "0" * 5000)
        self.tree(demo_files(**{"backends/cpu/demo/demo.backend.json": text}))
        rc, issues = self.issues()
        self.assertEqual([i["code"] for i in issues], ["J001"])
        self.assertEqual(issues[0]["message"], "a number in demo.backend.json has too many digits to "
                         "read; no manifest value needs that many")

    def test_duplicate_keys_are_errors(self):
        text = json.dumps(demo_manifest())[:-1] + ', "status": "planned"}'
        self.tree(demo_files(**{"backends/cpu/demo/demo.backend.json": text}))
        self.assertIssue("J002", 'duplicate key "status"; JSON keeps only the last value, remove the others')

    def test_top_level_must_be_an_object(self):
        self.tree(demo_files(**{"backends/cpu/demo/demo.backend.json": "[1, 2]"}))
        self.assertIssue("J003", "the manifest must be a JSON object, not [1, 2]")

    def test_non_utf8_manifest_is_an_error(self):
        self.tree(demo_files(**{"backends/cpu/demo/demo.backend.json": b'{"name": "d\xe9mo"}'}))
        self.assertIssue("J004", "demo.backend.json is not UTF-8 (first bad byte at offset 11); save it as UTF-8")

    def test_unreadable_manifest_is_an_error(self):
        self.tree(demo_files(manifest={}))
        os.remove(self.path("backends/cpu/demo/demo.backend.json"))
        os.mkdir(self.path("backends/cpu/demo/demo.backend.json"))
        self.assertIssue("J004", "cannot read demo.backend.json: not a regular file")

    @unittest.skipIf(hasattr(os, "geteuid") and os.geteuid() == 0,
                     "file permissions do not stop root from reading")
    def test_manifest_without_read_permission_is_an_error(self):
        self.tree(demo_files())
        os.chmod(self.path("backends/cpu/demo/demo.backend.json"), 0)
        self.assertIssue("J004", "cannot read demo.backend.json: Permission denied")

    def test_manifest_symlink_loop_is_an_error(self):
        self.tree(demo_files(manifest={}))
        os.remove(self.path("backends/cpu/demo/demo.backend.json"))
        os.symlink("demo.backend.json", self.path("backends/cpu/demo/demo.backend.json"))
        rc, issues = self.issues()
        self.assertEqual(rc, 1)
        self.assertEqual([i["code"] for i in issues], ["J004"])
        self.assertTrue(issues[0]["message"].startswith("cannot read demo.backend.json: "))

    def test_one_broken_backend_does_not_stop_the_others(self):
        files = demo_files()
        files.update(fat_files())
        files["backends/cuda/fat/fat.backend.json"] = "{"
        files["backends/cpu/demo/extra.c"] = ""
        self.tree(files)
        self.assertEqual(self.codes(), ["J001", "S004"])


class KeysTest(TreeTest):
    def test_missing_required_keys(self):
        manifest = demo_manifest()
        del manifest["sources"]
        del manifest["build"]["output"]
        self.tree(demo_files(manifest))
        self.assertIssue("M001", 'missing required key "sources"')
        self.assertIssue("M001", 'missing required key "build.output"')

    def test_boolean_is_not_an_integer(self):
        self.tree(demo_files(demo_manifest(abi_version=True)))
        self.assertIssue("M002", '"abi_version" must be an integer >= 1, not true')

    def test_nan_and_infinity_tolerances_are_errors(self):
        text = json.dumps(demo_manifest()).replace("1e-05", "NaN").replace(
            '"accumulation": "fp32"', '"accumulation": "fp32", "x": 1')
        text = text.replace('"tolerance": {', '"tolerance": {"softmax_f32": -Infinity, ')
        self.tree(demo_files(**{"backends/cpu/demo/demo.backend.json": text}))
        self.assertIssue("M002", '"numerics.tolerance.rmsnorm_f32" must be a finite number >= 0, not NaN')
        self.assertIssue("M002", '"numerics.tolerance.softmax_f32" must be a finite number >= 0, not -Infinity')

    def test_negative_tolerance_is_an_error(self):
        manifest = demo_manifest()
        manifest["numerics"]["tolerance"]["rmsnorm_f32"] = -1
        self.tree(demo_files(manifest))
        self.assertIssue("M002", '"numerics.tolerance.rmsnorm_f32" must be a finite number >= 0, not -1')

    def test_unknown_key_suggests_the_nearest(self):
        manifest = demo_manifest()
        manifest["build"]["min_capabilty"] = 80
        manifest["colour"] = "blue"
        self.tree(demo_files(manifest))
        rc, issues = self.issues()
        self.assertEqual(rc, 0)
        self.assertEqual([i["message"] for i in issues], [
            'unknown key "build.min_capabilty"; did you mean "min_capability"?',
            'unknown key "colour"'])

    def test_name_must_equal_directory(self):
        self.tree(demo_files(demo_manifest(name="other")))
        self.assertIssue("M004", 'name "other" differs from its directory "demo"; they must be equal')

    def test_name_must_be_lowercase(self):
        self.tree(demo_files(demo_manifest(name="Demo")))
        self.assertIssue("M002", '"name" must be a string of lowercase letters, digits and _, not "Demo"')

    def test_uppercase_name_is_an_error_even_when_it_equals_the_directory(self):
        files = {path.replace("cpu/demo/demo.", "cpu/Demo/Demo.").replace("cpu/demo/", "cpu/Demo/"): content
                 for path, content in demo_files(demo_manifest(name="Demo")).items()}
        self.tree(files)
        self.assertIssue("M002", '"name" must be a string of lowercase letters, digits and _, not "Demo"')

    def test_unknown_reference_key_is_a_warning(self):
        manifest = demo_manifest()
        manifest["reference"]["entry_point"] = "parity.py"
        self.tree(demo_files(manifest))
        self.assertIssue("M003", 'unknown key "reference.entry_point"; did you mean "entrypoint"?', "warning")

    def test_platform_must_equal_directory(self):
        self.tree(demo_files(demo_manifest(platform="cuda")))
        self.assertIssue("M005", 'platform "cuda" differs from its directory "cpu"')

    def test_status_must_be_known(self):
        self.tree(demo_files(demo_manifest(status="done")))
        self.assertIssue("M002", '"status" must be one of planned, experimental, validated, not "done"')

    def test_a_problem_in_one_part_does_not_hide_another(self):
        manifest = demo_manifest(sources=["ops.h", "ops.c", "gone.c"])
        manifest["build"]["architectures"] = "x86-64"
        manifest["numerics"] = 3
        self.tree(demo_files(manifest))
        # S009 too: were gone.c there, build.sh would not compile it.
        self.assertEqual(self.codes(), ["M002", "M002", "S001", "S009", "T001"])


class SourcesTest(TreeTest):
    def test_missing_source_is_an_error(self):
        self.tree(demo_files(demo_manifest(sources=["ops.h", "ops.c", "gone.cu"])))
        self.assertIssue("S001", "source gone.cu does not exist")

    def test_absolute_and_parent_paths_are_errors(self):
        self.tree(demo_files(demo_manifest(sources=["ops.h", "ops.c", "/etc/passwd", "../x.c"])))
        self.assertIssue("S002", 'source "/etc/passwd" is absolute; give it relative to the backend directory')
        self.assertIssue("S002", "source \"../x.c\" contains '..'; sources must stay inside the backend directory")

    def test_symlink_outside_is_an_error(self):
        self.tree(demo_files(demo_manifest(sources=["ops.h", "ops.c", "out.h"]),
                             **{"elsewhere/out.h": ""}))
        os.symlink(self.path("elsewhere/out.h"), self.path("backends/cpu/demo/out.h"))
        self.assertIssue("S002", "source out.h is a symbolic link that resolves outside the backend directory")

    def test_symlink_inside_is_fine(self):
        self.tree(demo_files(demo_manifest(sources=["ops.h", "ops.c", "alias.h"])))
        os.symlink("ops.h", self.path("backends/cpu/demo/alias.h"))
        self.assertClean()

    def test_duplicates_after_normalisation_are_errors(self):
        self.tree(demo_files(demo_manifest(sources=["ops.h", "ops.c", "./ops.h"])))
        self.assertIssue("S003", 'source ops.h is listed twice (as "ops.h" and "./ops.h")')

    def test_undeclared_kernel_source_is_named(self):
        self.tree(demo_files(**{"backends/cpu/demo/sub/extra.cpp": ""}))
        self.assertIssue("S004", "kernel source sub/extra.cpp is not declared in sources; add it, "
                         "or list it in excluded if it is not part of the library")

    def test_tests_and_excluded_files_need_not_be_declared(self):
        self.tree(demo_files(demo_manifest(excluded=["bench_*.c", "tools/*.cu"]), **{
            "backends/cpu/demo/test_ops.c": "", "backends/cpu/demo/tests/helper.c": "",
            "backends/cpu/demo/bench_ops.c": "", "backends/cpu/demo/tools/gen.cu": ""}))
        self.assertClean()

    def test_source_that_is_a_directory_is_an_error(self):
        self.tree(demo_files(demo_manifest(sources=["ops.h", "ops.c", "inc.h"])))
        os.mkdir(self.path("backends/cpu/demo/inc.h"))
        self.assertIssue("S005", "source inc.h is not a regular file")

    def test_fifo_source_is_not_read(self):
        self.tree(demo_files(demo_manifest(sources=["ops.h", "ops.c", "pipe.h"])))
        os.mkfifo(self.path("backends/cpu/demo/pipe.h"))
        self.assertIssue("S005", "source pipe.h is not a regular file")

    def test_source_symlink_loop_is_a_diagnostic(self):
        self.tree(demo_files(demo_manifest(sources=["ops.h", "ops.c", "loop.h"])))
        os.symlink("loop.h", self.path("backends/cpu/demo/loop.h"))
        os.symlink(".", self.path("backends/cpu/demo/self"))
        rc, issues = self.issues()
        self.assertEqual([i["code"] for i in issues], ["S005"])
        self.assertTrue(issues[0]["message"].startswith("source loop.h cannot be read: "))

    def test_non_utf8_source_is_a_warning(self):
        self.tree(demo_files(**{"backends/cpu/demo/ops.c": b"/* caf\xe9 */\nint x;\n"}))
        self.assertIssue("S006", "ops.c is not UTF-8 (first bad byte at offset 6)", "warning")

    def denied(self, name):
        """os.open refusing `name` (file permissions do not stop root)."""
        real_open = os.open

        def refusing(path, *args, **kwargs):
            if os.fspath(path).endswith("/" + name):
                raise PermissionError(13, "Permission denied", path)
            return real_open(path, *args, **kwargs)
        return mock.patch("os.open", refusing)

    def test_unreadable_source_is_an_error(self):
        for status in ("experimental", "planned"):
            with self.subTest(status=status):
                self.tree(demo_files(demo_manifest(status=status)))
                with self.denied("ops.c"):
                    rc, issues = self.issues()
                self.assertEqual(rc, 1)
                self.assertEqual([(i["code"], i["message"], i["path"]) for i in issues],
                                 [("S005", "source ops.c cannot be read: Permission denied",
                                   "backends/cpu/demo/ops.c")])

    def test_source_linked_outside_is_not_read(self):
        self.tree(demo_files(demo_manifest(sources=["ops.h", "ops.c", "far.h"]),
                             **{"elsewhere/far.h": "#define DEMO_ABI_VERSION 9\n"}))
        os.symlink("../../../elsewhere/far.h", self.path("backends/cpu/demo/far.h"))
        self.assertEqual(self.codes(), ["S002"])


class AbiTest(TreeTest):
    def cs1(self, header, abi=1, status="experimental", **extra):
        manifest = demo_manifest(abi_version=abi, status=status)
        return demo_files(manifest, **dict({"backends/cpu/demo/ops.h": header}, **extra))

    def test_mismatch_names_file_and_line(self):
        self.tree(self.cs1("// ABI\n#define CS1_ABI_VERSION 4\nunsigned cs1_abi_version(void);\n"
                           "const char* cs1_error_string(int);\n"))
        issues = self.assertIssue("A001", "abi_version is 1 but ops.h defines CS1_ABI_VERSION 4 (line 2); "
                                  "make them equal")
        self.assertEqual((issues[0]["path"], issues[0]["line"]), ("backends/cpu/demo/ops.h", 2))

    def test_accepted_literal_forms(self):
        decls = "unsigned cs1_abi_version(void);\nconst char* cs1_error_string(int);\n"
        for literal in ("4", "(4)", "4u", "0x4", "4 // four", "4 /* four */", "( 4U )"):
            with self.subTest(literal=literal):
                self.tree(self.cs1("#define CS1_ABI_VERSION %s\n%s" % (literal, decls), abi=4))
                self.assertClean()

    def test_comments_and_if0_blocks_are_ignored(self):
        self.tree(self.cs1("/* #define CS1_ABI_VERSION 9\n*/\n// #define CS1_ABI_VERSION 8\n"
                           "#if 0\n#ifdef X\n#endif\n#define CS1_ABI_VERSION 7\n#else\n"
                           "#define CS1_ABI_VERSION 3\n#endif\n"
                           "unsigned cs1_abi_version(void);\nconst char* cs1_error_string(int);\n", abi=3))
        self.assertClean()

    def test_only_directives_at_line_start_count(self):
        # `#if 0` after code is no directive; a name that merely contains
        # _ABI_VERSION, or a second one on the same line, defines nothing.
        self.tree(self.cs1("int a; #if 0\nint CS1_ABI_VERSION_x = CS1_ABI_VERSION;\n"
                           "  #  define CS1_ABI_VERSION 5 /* CS1_ABI_VERSION 6 */\n"
                           "/* */ #if 0\n#define CS1_ABI_VERSION 7\n#endif\n"
                           "unsigned cs1_abi_version(void);\nconst char* cs1_error_string(int);\n",
                           abi=1))
        issues = self.assertIssue("A001", "abi_version is 1 but ops.h defines CS1_ABI_VERSION 5 "
                                  "(line 3); make them equal")
        self.assertEqual([i["code"] for i in issues], ["A001"])

    def test_several_values_in_one_file_name_their_lines(self):
        self.tree(self.cs1("// one\n#define CS1_ABI_VERSION 1\n\n#define CS1_ABI_VERSION 2\n/* x\n*/\n"
                           "#define CS1_ABI_VERSION 3\n"))
        self.assertIssue("A002", "several ABI versions are defined (ops.h:2 defines CS1_ABI_VERSION 1, "
                         "ops.h:4 defines CS1_ABI_VERSION 2, ops.h:7 defines CS1_ABI_VERSION 3); "
                         "keep exactly one")

    def test_several_values_are_one_error(self):
        files = self.cs1("#define CS1_ABI_VERSION 1\nunsigned cs1_abi_version(void);\n"
                         "const char* cs1_error_string(int);\n")
        files["backends/cpu/demo/ops.c"] = "\n#define CS1_ABI_VERSION 2\n"
        self.tree(files)
        self.assertIssue("A002", "several ABI versions are defined (ops.h:1 defines CS1_ABI_VERSION 1, "
                         "ops.c:2 defines CS1_ABI_VERSION 2); keep exactly one")

    def test_no_macro_is_a_warning_when_experimental(self):
        self.tree(self.cs1("int x;\n"))
        self.assertIssue("A003", "no #define <PREFIX>_ABI_VERSION in the declared sources; add one "
                         "equal to abi_version", "warning")

    def test_no_macro_is_an_error_when_validated(self):
        self.tree(self.cs1("int x;\n", status="validated"))
        self.assertIssue("A003", "no #define <PREFIX>_ABI_VERSION in the declared sources; add one "
                         "equal to abi_version", "error")

    def test_abi_functions_are_checked_without_the_macro(self):
        self.tree(self.cs1("unsigned cs1_abi_version(void);\n"))
        rc, issues = self.issues()
        self.assertEqual([(i["code"], i["message"]) for i in issues if i["code"] == "A004"], [
            ("A004", "no declaration of %s_error_string() in the declared sources; the C ABI "
             "requires it" % prefix) for prefix in ("cs1", "demo")])  # ops.c defines demo_abi_version()
        self.tree(self.cs1("int x;\n", **{"backends/cpu/demo/ops.c": "int x;\n"}))
        self.assertIssue("A004", "no declaration of a <prefix>_abi_version() in the declared sources; "
                         "the C ABI requires it, and <prefix>_error_string()", "warning")

    def test_macro_that_is_not_a_literal_is_an_error(self):
        self.tree(self.cs1("#define CS1_ABI_VERSION (MAJOR * 10)\n"))
        self.assertIssue("A005", 'ops.h defines CS1_ABI_VERSION as "(MAJOR * 10)", not an integer literal')
        self.assertEqual(self.codes(), ["A004", "A004", "A005"])  # not also "no #define"

    def test_windows_line_ends_are_read(self):
        self.tree(self.cs1("#define CS1_ABI_VERSION 4\r\n#if 0\r\n#define CS1_ABI_VERSION 5\r\n"
                           "#endif\r\nunsigned cs1_abi_version(void);\r\n"
                           "const char* cs1_error_string(int);\r\n", abi=4))
        self.assertClean()

    def test_missing_error_string_declaration_is_a_warning(self):
        self.tree(self.cs1("#define CS1_ABI_VERSION 1\nunsigned cs1_abi_version(void);\n"
                           "// const char* cs1_error_string(int);\n"))
        self.assertIssue("A004", "no declaration of cs1_error_string() in the declared sources; the C "
                         "ABI requires it", "warning")


class BuildScriptTest(TreeTest):
    def test_header_comments_naming_the_library_do_not_hide_a_difference(self):
        # Scripts that differ only in a header comment share their reading;
        # the lines after it are still each script's own.
        files = {}
        for name, cap in (("a", 90), ("b", 80), ("c", 90)):
            files.update({
                "backends/cuda/%s/%s.backend.json" % (name, name): {
                    "name": name, "abi_version": 1, "status": "experimental", "sources": ["k.cu"],
                    "build": {"script": "build.sh", "output": "lib%s.so" % name,
                              "architectures": [90]}},
                "backends/cuda/%s/k.cu" % name: "#define %s_ABI_VERSION 1\nint %s_abi_version(void);\n"
                                                 "const char *%s_error_string(int);\n"
                                                 % (name.upper(), name, name),
                "backends/cuda/%s/build.sh" % name: Executable(
                    "#!/bin/bash\n# Build lib%s.so\nout=$1\nmkdir -p \"$out\"\nnvcc -shared -arch=sm_%d k.cu \\\n"
                    "  -o \"$out/lib%s.so\"\n" % (name, cap, name))})
        self.tree(files)
        found = sorted((i["backend"], i["code"], i["line"]) for i in self.issues()[1])
        self.assertEqual(found, [("cuda/b", "B006", 5), ("cuda/b", "B007", 5)])

    def test_missing_script_is_an_error(self):
        files = demo_files()
        del files["backends/cpu/demo/build.sh"]
        self.tree(files)
        self.assertIssue("B001", "build script build.sh does not exist")

    def test_script_symlink_loop_is_a_diagnostic(self):
        files = demo_files()
        del files["backends/cpu/demo/build.sh"]
        self.tree(files)
        os.symlink("build.sh", self.path("backends/cpu/demo/build.sh"))
        self.assertIssue("B001", "build script build.sh does not exist")

    def test_script_that_is_a_directory_is_an_error(self):
        files = demo_files()
        del files["backends/cpu/demo/build.sh"]
        self.tree(files)
        os.mkdir(self.path("backends/cpu/demo/build.sh"))
        self.assertIssue("B001", "build script build.sh is not a regular file")

    def test_script_not_executable_is_an_error(self):
        self.tree(demo_files(**{"backends/cpu/demo/build.sh": str(CPU_BUILD)}))
        self.assertIssue("B002", "build script build.sh is not executable; run: chmod +x "
                         "backends/cpu/demo/build.sh")

    def git(self, *args):
        subprocess.run(["git", "-C", self.root] + list(args), check=True,
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    def test_script_not_executable_in_git_index_is_an_error(self):
        self.tree(demo_files())
        self.git("init", "-q")
        self.git("-c", "core.fileMode=false", "add", ".")
        self.git("update-index", "--chmod=-x", "backends/cpu/demo/build.sh")
        self.assertIssue("B003", "build script build.sh has mode 100644 in the git index; run: "
                         "git update-index --chmod=+x backends/cpu/demo/build.sh")
        self.git("update-index", "--chmod=+x", "backends/cpu/demo/build.sh")
        self.assertClean()

    def test_git_index_of_a_repository_root_below_the_git_top_is_read(self):
        self.tree({"sub/" + path: content for path, content in demo_files().items()})
        self.git("init", "-q")
        self.git("-c", "core.fileMode=false", "add", ".")
        self.git("update-index", "--chmod=-x", "sub/backends/cpu/demo/build.sh")
        rc, out, err = run_main(["--repo-root", self.path("sub")])
        self.assertIn("backends/cpu/demo/build.sh: [error] B003 cpu/demo: build script build.sh has "
                      "mode 100644 in the git index; run: "
                      "git update-index --chmod=+x backends/cpu/demo/build.sh\n", out)

    def test_git_index_is_read_however_the_root_is_spelt(self):
        self.tree({"sub/" + path: content for path, content in demo_files().items()})
        self.git("init", "-q")
        self.git("-c", "core.fileMode=false", "add", ".")
        self.git("update-index", "--chmod=-x", "sub/backends/cpu/demo/build.sh")
        link = self.root + "-link"  # outside the work tree, to a root below its top
        os.symlink(self.path("sub"), link)
        self.addCleanup(os.unlink, link)
        sub = self.path("sub")
        for argv in (["--repo-root", link], ["--repo-root", sub, "--backends-dir", "./backends"],
                     ["--repo-root", sub, "--backends-dir", "backends/"]):
            with self.subTest(argv=argv):
                rc, out, err = run_main(argv)
                self.assertIn("build script build.sh has mode 100644 in the git index", out)

    def test_build_script_tracked_as_a_link_runs_its_target(self):
        files = demo_files()
        files["backends/cpu/demo/real.sh"] = files.pop("backends/cpu/demo/build.sh")
        self.tree(files)
        os.symlink("real.sh", self.path("backends/cpu/demo/build.sh"))
        self.git("init", "-q")
        self.git("add", ".")
        self.assertClean()

    def test_untracked_build_script_has_no_index_mode(self):
        self.tree(demo_files())
        self.git("init", "-q")
        self.git("add", "backends/cpu/demo/demo.backend.json")
        self.assertClean()

    def test_output_must_equal_build_output(self):
        manifest = demo_manifest()
        manifest["build"]["output"] = "libother.so"
        self.tree(demo_files(manifest))
        issues = self.assertIssue("B004", 'build script build.sh writes "libdemo.so" but build.output is "libother.so"')
        self.assertEqual(issues[0]["line"], 8)

    def test_set_o_pipefail_is_not_an_output(self):
        script = Executable("#!/bin/sh\nset -o pipefail\nmkdir -p \"$1\"\nmarch=${2:-x86-64}\n"
                            "gcc -march=$march -shared ops.c -o $1/libdemo.so\nset -o errexit\n")
        self.tree(demo_files(**{"backends/cpu/demo/build.sh": script}))
        self.assertClean()

    def test_script_without_compiler_output_is_an_error(self):
        self.tree(demo_files(**{"backends/cpu/demo/build.sh": Executable(
            "#!/bin/sh\ncc -march=x86-64 -c ops.c\n")}))
        self.assertIssue("B005", "build script build.sh has no compiler command with -o; the script "
                         "must write build.output into its <output-dir> argument")

    def test_a_script_that_builds_through_make_cannot_be_told(self):
        self.tree(demo_files(**{"backends/cpu/demo/build.sh": Executable("#!/bin/sh\nmake -C src\n")}))
        self.assertIssue("B017", "cannot tell which library build.sh writes: it has no compiler "
                         "command with -o that the checker can see; the checker does not follow "
                         "line 2 (make, whose build rules it does not read)", "warning")

    def test_fat_cuda_library_matches(self):
        self.tree(fat_files())
        self.assertClean()

    def test_claimed_arch_not_built_is_an_error(self):
        self.tree(fat_files(architectures=[80, 89, 90, 100]))
        self.assertIssue("B006", "build.architectures lists 100 but the default invocation of build.sh "
                         "does not build it")

    def test_built_arch_not_claimed_is_an_error(self):
        self.tree(fat_files(architectures=[80, 90]))
        self.assertIssue("B007", "build.sh also builds 89, which build.architectures does not list; "
                         "list it (the build tier rejects a library with targets the manifest does "
                         "not name, R008)")

    def test_arch_branch_before_default_branch_is_not_reached(self):
        files = fat_files()
        files["backends/cuda/fat/build.sh"] = Executable(
            '#!/usr/bin/env bash\nout_dir="$1"\nmkdir -p "$1"\nif [ $# -lt 2 ]; then\n'
            "  targets=(-gencode arch=compute_80,code=sm_80 -gencode arch=compute_89,code=sm_89\n"
            "           -gencode arch=compute_90,code=sm_90)\n"
            'else\n  targets=(-gencode "arch=compute_$2,code=sm_$2")\nfi\n'
            'nvcc -shared "${targets[@]}" -o "$out_dir/libfat.so" ops.cu\n')
        self.tree(files)
        self.assertClean()

    def single_target(self, default_expr, architectures, default_arch):
        files = fat_files(architectures=architectures, default_arch=default_arch)
        files["backends/cuda/fat/build.sh"] = Executable(
            '#!/bin/bash\nset -eu\nout=$1\nmkdir -p "$out"\ncap=%s\n'
            'nvcc -shared -arch=sm_$cap ops.cu -o "$out"/libfat.so\n' % default_expr)
        return files

    def test_nested_default_gives_the_single_target(self):
        self.tree(self.single_target("${2:-${CUDA_COMPUTE_CAP:-89}}", [89], 89))
        self.assertClean()

    def test_default_arch_must_equal_script_default(self):
        self.tree(self.single_target("${2:-${CUDA_COMPUTE_CAP:-89}}", [89, 90], 90))
        self.assertIssue("B009", "build.default_arch is 90 but build.sh defaults its target to 89 (${2:-89})")

    def test_default_arch_must_be_listed(self):
        self.tree(fat_files(default_arch=75))
        self.assertIssue("B008", "build.default_arch 75 is not in build.architectures")

    def test_arch_below_min_capability_is_an_error(self):
        self.tree(fat_files(min_capability=89))
        self.assertIssue("B010", "architecture 80 is below build.min_capability 89")

    def test_target_rules_do_not_need_the_script(self):
        for script in ("missing.sh", 42):
            with self.subTest(script=script):
                self.tree(fat_files(script=script, default_arch=75, min_capability=89))
                self.assertIssue("B008", "build.default_arch 75 is not in build.architectures")
                self.assertIssue("B010", "architecture 80 is below build.min_capability 89")

    def test_windows_line_ends_in_the_script_are_an_error(self):
        self.tree(demo_files(**{"backends/cpu/demo/build.sh": Executable(
            CPU_BUILD.replace("\n", "\r\n"))}))
        self.assertIssue("B012", "build script build.sh has Windows (CRLF) line ends, which bash "
                         "reads as part of each command; convert it (dos2unix "
                         "backends/cpu/demo/build.sh), and if git converts it on checkout, add "
                         "'*.sh text eol=lf' to .gitattributes")

    def test_arch_form_is_checked_per_platform(self):
        manifest = demo_manifest()
        manifest["build"]["architectures"] = ["x86 64"]
        self.tree(demo_files(manifest))
        self.assertIssue("B011", 'architecture "x86 64" is not a -march value such as "x86-64"')

    def test_scripts_sharing_lines_are_each_read_with_their_own_variables(self):
        # Backends' scripts often share lines; what a line builds still
        # depends on the lines before it in its own script.
        lines = {"a": ("cap=90", "nvcc -shared -arch=sm_$cap k.cu -o \"$out/libk.so\""),
                 "b": ("cap=80", "nvcc -shared -arch=sm_${cap} k.cu -o \"$out/libk.so\""),
                 "c": ("cap=90", "nvcc -shared -arch=sm_${cap} k.cu -o \"$out/libk.so\""),
                 "d": ("cap=90", "true")}
        files = {}
        for name, (first, second) in lines.items():
            files.update({
                "backends/cuda/%s/%s.backend.json" % (name, name): {
                    "name": name, "abi_version": 1, "status": "experimental", "sources": ["k.cu"],
                    "build": {"script": "build.sh", "output": "libk.so", "architectures": [90]}},
                "backends/cuda/%s/k.cu" % name: "#define %s_ABI_VERSION 1\nint %s_abi_version(void);\n"
                                                 "const char *%s_error_string(int);\n"
                                                 % (name.upper(), name, name),
                "backends/cuda/%s/build.sh" % name: Executable(
                    "#!/bin/bash\nout=$1\nmkdir -p \"$out\"\n%s\n%s\n" % (first, second))})
        self.tree(files)
        found = sorted((i["backend"], i["code"], i["message"]) for i in self.issues()[1])
        self.assertEqual(found, [
            ("cuda/b", "B006", "build.architectures lists 90 but the default invocation of build.sh "
                               "does not build it"),
            ("cuda/b", "B007", "build.sh also builds 80, which build.architectures does not list; "
                               "list it (the build tier rejects a library with targets the "
                               "manifest does not name, R008)"),
            ("cuda/d", "B005", "build script build.sh has no compiler command with -o; the script "
                               "must write build.output into its <output-dir> argument"),
        ])

    def test_a_compile_naming_no_target_builds_the_compiler_default_which_check_cannot_tell(self):
        # nvcc 13 builds sm_75 with no -arch (nvcc --dryrun shows it), CUDA 12 sm_52; gcc the
        # distribution's -march; hipcc the machine's GPU, or gfx803 without one.
        for platform, compiler, arch, flags in (("cuda", "nvcc", 75, ""), ("cpu", "gcc", "x86-64", ""),
                                                ("hip", "hipcc", "gfx90a", ""),
                                                ("cuda", "nvcc", 75, " -Xcompiler -O2")):
            with self.subTest(compiler=compiler, flags=flags):
                shutil.rmtree(self.root, ignore_errors=True)
                os.makedirs(self.root)
                source = {"cuda": "k.cu", "hip": "k.hip", "cpu": "k.c"}[platform]
                self.tree({"backends/%s/k/k.backend.json" % platform: {
                    "name": "k", "platform": platform, "abi_version": 1, "status": "experimental",
                    "sources": ["k.h", source], "build": {"script": "build.sh", "output": "libk.so",
                                                         "architectures": [arch]}},
                    "backends/%s/k/k.h" % platform: "#define K_ABI_VERSION 1\nunsigned k_abi_version(void);\n"
                                                    "const char* k_error_string(int code);\n",
                    "backends/%s/k/%s" % (platform, source): "",
                    "backends/%s/k/build.sh" % platform: Executable(
                        '#!/usr/bin/env bash\nset -e\nmkdir -p "$1"\n%s -shared -fPIC%s -o "$1/libk.so" '
                        '"$(dirname "$0")/%s"\n' % (compiler, flags, source))})
                rc, issues = self.issues()
                self.assertEqual([(i["code"], i["message"]) for i in issues if i["code"].startswith("B")], [
                    ("B017", "cannot tell whether build.sh builds %s: %s at line 4 names no target, so "
                             "it builds its compiler's default, which depends on the compiler's version "
                             "and the machine (name each target with a flag)" % (arch, compiler))])

    def test_march_native_is_no_target(self):
        self.tree(demo_files(demo_manifest(build={"script": "build.sh", "output": "libdemo.so",
                                                  "architectures": ["native"]}),
                             **{"backends/cpu/demo/build.sh": Executable(
                                 '#!/bin/sh\nmkdir -p "$1"\ncc -shared -march=native ops.c -o "$1/libdemo.so"\n')}))
        rc, issues = self.issues()
        self.assertEqual(sorted((i["code"], i["message"]) for i in issues), [
            ("B006", "build.architectures lists native but the default invocation of build.sh does "
                     "not build it"),
            ("B011", 'architecture "native" is not a -march value such as "x86-64"'),
            ("B011", "build.sh builds with -march=native, which is no fixed list of targets (it depends "
                     "on the compiler's version or the machine it runs on); list the targets, one flag each"),
])

    def test_hip_offload_arch_is_read(self):
        self.tree({
            "backends/hip/rocm/rocm.backend.json": {
                "name": "rocm", "abi_version": 1, "status": "experimental", "sources": ["k.hip"],
                "build": {"script": "build.sh", "output": "librocm.so", "architectures": ["gfx942", "gfx90a"]}},
            "backends/hip/rocm/k.hip": "#define ROCM_ABI_VERSION 1\nint rocm_abi_version(void);\n"
                                       "const char *rocm_error_string(int);\n",
            "backends/hip/rocm/build.sh": Executable(
                "#!/bin/bash\nout_dir=$1\nmkdir -p \"$1\"\nhipcc --offload-arch=gfx942 \\\n  --offload-arch=gfx90a "
                "-shared k.hip -o \"${out_dir}/librocm.so\"\n")})
        self.assertClean()

    def hip_files(self, script, architectures):
        return {
            "backends/hip/rocm/rocm.backend.json": {
                "name": "rocm", "abi_version": 1, "status": "experimental", "sources": ["k.hip"],
                "build": {"script": "build.sh", "output": "librocm.so",
                          "architectures": architectures}},
            "backends/hip/rocm/k.hip": "#define ROCM_ABI_VERSION 1\nint rocm_abi_version(void);\n"
                                       "const char *rocm_error_string(int);\n",
            "backends/hip/rocm/build.sh": Executable("#!/bin/bash\nmkdir -p \"$1\"\n" + script)}

    def test_hip_target_lists_features_and_generic_targets_are_read(self):
        for script in ('hipcc --offload-arch=gfx90a:xnack+,gfx11-generic -shared k.hip -o "$1/librocm.so"\n',
                       'hipcc -mcpu=gfx90a:xnack+ --amdgpu-target=gfx11-generic -o "$1/librocm.so"\n',
                       'hipcc --genco --targets gfx90a:xnack+,gfx11-generic k.hip -o "$1/librocm.so"\n'):
            with self.subTest(script=script):
                self.tree(self.hip_files(script, ["gfx90a:xnack+", "gfx11-generic"]))
                self.assertClean()

    def test_versioned_and_wrapped_compilers_are_read(self):
        for command in ("gcc-12", "ccache cc", "CCACHE_DISABLE=1 cc", "sccache clang-18"):
            with self.subTest(command=command):
                self.tree(demo_files(**{"backends/cpu/demo/build.sh": Executable(
                    "#!/bin/sh\nmkdir -p \"$1\"\n%s -shared -march=x86-64 ops.c -o \"$1/libdemo.so\"\n" % command)}))
                self.assertClean()

    def test_a_probe_to_dev_null_is_not_the_output(self):
        self.tree(demo_files(**{"backends/cpu/demo/build.sh": Executable(
            '#!/bin/sh\nmkdir -p "$1"\ncc -shared -march=x86-64 ops.c -o "$1/libdemo.so"\n'
            'cc -march=x86-64 -x c /dev/null -o /dev/null\n')}))
        self.assertClean()

    def test_all_and_native_targets_are_no_fixed_list(self):
        for flag in ("-arch=all", "-arch=all-major", "-arch=native"):
            with self.subTest(flag=flag):
                self.tree(fat_files())
                write_tree(self.root, {"backends/cuda/fat/build.sh": Executable(
                    '#!/bin/bash\nmkdir -p "$1"\nnvcc -shared %s ops.cu -o "$1/libfat.so"\n' % flag)})
                self.assertIssue("B011", "build.sh builds with %s, which is no fixed list of targets "
                                 "(it depends on the compiler's version or the machine it runs on); "
                                 "list the targets, one flag each" % flag)

    def test_ptx_only_is_not_a_built_architecture(self):
        self.tree(fat_files(architectures=[80], default_arch=80))
        write_tree(self.root, {"backends/cuda/fat/build.sh": Executable(
            '#!/bin/bash\nnvcc -shared -arch=compute_80 ops.cu -o "$1/libfat.so"\n')})
        self.assertIssue("B006", "build.architectures lists 80 but build.sh builds only PTX for it "
                         "(compute_80), which is compiled when the library is loaded, not machine "
                         "code; add code=sm_80")

    def test_library_written_outside_the_output_dir_is_an_error(self):
        self.tree(demo_files(**{"backends/cpu/demo/build.sh": Executable(
            '#!/bin/sh\nmkdir -p build\ncc -shared -march=x86-64 ops.c -o build/libdemo.so\n')}))
        issues = self.assertIssue(
            "B013", "build script build.sh writes its library to build/libdemo.so (relative to the "
            "directory the script is run from), not under its "
            "<output-dir> argument ($1): the build tier and CI look for libdemo.so in <output-dir>; "
            "write -o \"$1/libdemo.so\"")
        self.assertEqual([i["line"] for i in issues if i["code"] == "B013"], [3])

    def test_script_without_a_working_shebang_is_an_error(self):
        for first, message in (
                ("set -e", "build script build.sh has no #! line, so ./build.sh cannot run; start it "
                           "with #!/usr/bin/env bash"),
                ("#!/usr/env/bin bash", "build script build.sh starts with #!/usr/env/bin bash, an "
                                        "interpreter that is not on a standard system, so ./build.sh "
                                        "cannot run; start it with #!/usr/bin/env bash")):
            with self.subTest(first=first):
                self.tree(demo_files(**{"backends/cpu/demo/build.sh": Executable(
                    CPU_BUILD.replace("#!/usr/bin/env bash", first))}))
                self.assertIssue("B014", message)

    def test_build_output_outside_the_output_dir_is_an_error(self):
        for output in ("/usr/lib/libdemo.so", "../libdemo.so", "lib/../../libdemo.so"):
            with self.subTest(output=output):
                manifest = demo_manifest()
                manifest["build"]["output"] = output
                self.tree(demo_files(manifest))
                self.assertEqual(self.codes(), ["B015"])

    def test_abi_version_define_must_agree_with_the_manifest(self):
        self.tree(demo_files(**{"backends/cpu/demo/build.sh": Executable(
            '#!/bin/sh\nmkdir -p "$1"\ncc -shared -march=x86-64 -DDEMO_ABI_VERSION=2 ops.c -o "$1/libdemo.so"\n')}))
        self.assertIssue("B016", "build.sh compiles with -DDEMO_ABI_VERSION=2 but abi_version is 1; "
                         "the library would report another ABI version than the manifest")
        write_tree(self.root, {"backends/cpu/demo/build.sh": Executable(
            '#!/bin/sh\nmkdir -p "$1"\ncc -shared -march=x86-64 -DDEMO_ABI_VERSION=1 ops.c -o "$1/libdemo.so"\n')})
        self.assertClean()

    def test_planned_backend_gets_only_manifest_and_abi_checks(self):
        manifest = demo_manifest(status="planned", sources=["ops.h", "ops.c", "later.c"])
        manifest["build"]["output"] = "libother.so"
        del manifest["reference"]
        self.tree(demo_files(manifest, **{"backends/cpu/demo/build.sh": "not executable"}))
        self.assertClean()

class ShebangTest(TreeTest):
    """B014: `#!/usr/bin/env` needs the interpreter's name after it."""

    def test_a_bare_env_line_names_no_interpreter(self):
        for first in ("#!/usr/bin/env", "#!/usr/bin/env   "):
            with self.subTest(first=first):
                self.tree(demo_files(**{"backends/cpu/demo/build.sh": Executable(
                    CPU_BUILD.replace("#!/usr/bin/env bash", first))}))
                self.assertIssue("B014", "build script build.sh starts with #!/usr/bin/env, an "
                                 "interpreter that is not on a standard system, so ./build.sh "
                                 "cannot run; start it with #!/usr/bin/env bash")

    def test_env_with_an_interpreter_is_clean(self):
        for first in ("#!/usr/bin/env bash", "#!/bin/bash"):
            with self.subTest(first=first):
                self.tree(demo_files(**{"backends/cpu/demo/build.sh": Executable(
                    CPU_BUILD.replace("#!/usr/bin/env bash", first))}))
                self.assertClean()


class CompilerCallTest(unittest.TestCase):
    """compiler_call(): what one compiler call builds, from its argv."""

    def call(self, *words):
        return check_contract.compiler_call(list(words), 7)

    def test_what_a_call_compiles_for_a_platform_with_no_target_flag(self):
        self.assertTrue(self.call("nvcc", "-shared", "-x", "cu", "k.cpp", "-o", "l.so").names_no_target("cuda"))
        self.assertTrue(self.call("clang++", "-x", "hip", "-c", "k.cpp").names_no_target("hip"))
        self.assertTrue(self.call("hipcc", "-c", "k.cpp").names_no_target("hip"))
        self.assertFalse(self.call("g++", "-shared", "k.cpp", "-o", "l.so").names_no_target("cuda"))
        self.assertFalse(self.call("nvcc", "-shared", "-arch=sm_80", "k.cu", "-o", "l.so").names_no_target("cuda"))
        self.assertFalse(self.call("nvcc", "-shared", "k.o", "-o", "l.so").names_no_target("cuda"))  # a link

    def test_a_path_under_an_unknown_directory_holds_no_target_flag(self):
        R = check_contract.runtime
        for word in (R("$ROOT") + "/codec2/..", "-I" + R("$D") + "/codegen", R("$D") + "/search.cu",
                     R("$D") + "/architecture/asm_x.cu"):
            with self.subTest(word=word):
                self.assertEqual(self.call("nvcc", "-shared", "-arch=sm_80", word, "-o", "l.so").unknown, [])
        for word in (R("$FLAGS"), "-arch=sm_" + R("$A"), "arch=compute_" + R("$A"), "--amdgpu-target=" + R("$T"),
                     "--gpu-architecture=" + R("$A"), "-Xcompiler=-march=" + R("$M"), "gfx" + R("$N")):
            with self.subTest(word=word):
                self.assertNotEqual(self.call("nvcc", "-shared", word, "-o", "l.so").unknown, [])

    def test_compiler_words_through_wrappers_and_versions(self):
        for words in (["gcc-12"], ["clang++-18"], ["/opt/rocm/bin/amdclang++"], ["ccache", "cc"],
                      ["sccache", "nvcc"], ["CCACHE_DISABLE=1", "cc"], ["env", "A=1", "hipcc"],
                      ["x86_64-linux-gnu-g++"], ["/usr/local/cuda/bin/nvcc"]):
            with self.subTest(words=words):
                self.assertIsNotNone(self.call(*words + ["-c", "k.c"]))
        for words in (["echo", "-o", "x"], ["make", "-j2"], ["clang-format", "-i", "k.c"],
                      ["python3", "-shared", "-o", "x"]):
            with self.subTest(words=words):
                self.assertIsNone(self.call(*words))

    def test_nvcc_flag_variables_and_options_files_as_nvcc_reads_them(self):
        # nvcc 13 splits its variables at white space, quotes kept (a quoted
        # -gencode value is "missing code"); an options file groups "..." words.
        env = {"NVCC_PREPEND_FLAGS": "-gencode=arch=compute_86,code=sm_86",
               "NVCC_APPEND_FLAGS": "-gencode arch=compute_90,code=sm_90"}
        self.assertEqual(check_contract.compiler_call(["nvcc", "-c", "k.cu"], 1, None, env).sass,
                         ["86", "90"])
        self.assertEqual(self.call("NVCC_APPEND_FLAGS=-arch=sm_89", "nvcc", "-c", "k.cu").sass, ["89"])
        self.assertEqual(self.call("HIPCC_COMPILE_FLAGS_APPEND=--offload-arch=gfx906", "hipcc", "-c",
                                   "k.hip").hip, ["gfx906"])
        self.assertEqual(check_contract.compiler_call(["gcc", "-c", "k.c"], 1, None, env).sass, [])
        files = {"/s/o1": '-gencode "arch=compute_89,code=sm_89"\n', "/s/o2": "-arch=sm_80"}
        for flags in (["-optf", "o1,o2"], ["--options-file=o1", "-optf=o2"]):
            with self.subTest(flags=flags):
                call = check_contract.compiler_call(["nvcc", "-c", "k.cu"] + flags, 1, "/s",
                                                    options_file=files.get)
                self.assertEqual((call.sass, call.unknown), (["89", "80"], []))
        self.assertEqual(self.call("nvcc", "-c", "k.cu", "-optf", "o1").unknown,
                         ["-optf o1, a file of options the checker cannot read"])

    def test_build_systems_compiler_probes_build_nothing(self):
        for words, cwd in ((["cc", "-march=armv8-a", "-o", "conftest", "conftest.c"], "/b"),
                           (["gcc", "-c", "-mcpu=cortex-m3", "CMakeCCompilerId.c"],
                            "/b/CMakeFiles/3.25.1/CompilerIdC"),
                           (["nvcc", "-arch=sm_52", "-o", "cmTC_1", "x.cu"],
                            "/b/CMakeFiles/CMakeScratch/TryCompile-a1"),
                           (["cc", "-march=znver4", "-o", "/b/meson-private/sanity", "s.c"], None)):
            with self.subTest(words=words):
                call = check_contract.compiler_call(words, 1, cwd)
                self.assertEqual((call.outputs, call.inputs, call.targets(None)), ([], [], []))
        call = check_contract.compiler_call(["cc", "-march=x86-64", "-c", "k.c", "-o", "k.o"], 1,
                                            "/b/CMakeFiles/k.dir")
        self.assertEqual((call.outputs, call.targets(None)), (["/b/CMakeFiles/k.dir/k.o"], ["x86-64"]))

    def test_gcc_and_clang_response_files_are_read_as_the_shell_quotes(self):
        files = {"/s/flags": "-march=haswell '-DK_ABI_VERSION=1' \"k 2.c\""}
        for compiler in ("gcc", "clang++-18", "hipcc"):
            with self.subTest(compiler=compiler):
                call = check_contract.compiler_call([compiler, "@flags", "-c"], 1, "/s",
                                                    options_file=files.get)
                self.assertEqual((call.march, call.abi_defines, call.unknown),
                                 (["haswell"], [("K", "1")], []))
        call = self.call("cc", "@flags", "-shared", "-o", "/o/l.so")
        self.assertEqual((call.unknown, call.opaque),
                         (["@flags, a file of options the checker cannot read"], True))
        self.assertEqual(self.call("nvcc", "@flags", "-c", "k.cu").unknown, [])  # nvcc has no @file

    def test_an_unknown_command_word_with_a_compilers_arguments_is_a_compiler(self):
        unknown = check_contract.RUNTIME + '$(command -v nvcc)' + check_contract.RUNTIME
        self.assertEqual(self.call(unknown, "-gencode", "arch=compute_89,code=sm_89", "-o",
                                   "/o/l.so").sass, ["89"])
        self.assertIsNotNone(self.call(unknown, "-shared", "-o", "/o/l.so"))
        self.assertIsNotNone(self.call(unknown, "--offload-arch=gfx942", "-c", "k.hip"))
        self.assertIsNone(self.call(unknown, "-o", "/o/l.so"))

    def test_outputs_and_probes(self):
        call = self.call("cc", "-march=native", "-x", "c", "-", "-o", "/dev/null")
        self.assertEqual((call.outputs, call.probes), ([], 1))
        # nvcc takes -o FILE, -o=FILE and --output-file, not -oFILE (nvcc 13: "Unknown
        # option"): its -odir and -optf are other options.  gcc and clang take -oFILE.
        for flags in (["-o", "/o/l.so"], ["-o=/o/l.so"], ["--output-file", "/o/l.so"],
                      ["--output-file=/o/l.so"]):
            with self.subTest(flags=flags):
                self.assertEqual(self.call("nvcc", "-shared", *flags).outputs, ["/o/l.so"])
        self.assertEqual(self.call("nvcc", "-c", "-odir", "/o", "k.cu").outputs, [])
        self.assertEqual(self.call("gcc", "-shared", "-o/o/l.so").outputs, ["/o/l.so"])
        self.assertEqual(check_contract.compiler_call(["cc", "-o", "l.so"], 1, "/o").outputs,
                         ["/o/l.so"])

    @unittest.skipUnless(shutil.which("nvcc"), "nvcc is not installed, so its reading of the "
                                                "target flags cannot be compared")
    def test_nvcc_targets_are_what_nvcc_dryrun_builds(self):
        # Each form against the real nvcc: `nvcc --dryrun` lists the machine
        # code (kind=elf) and PTX (kind=ptx) it would put in the fatbinary.
        forms = [["-arch=sm_80"], ["-arch=compute_80"], ["--gpu-architecture", "sm_75"],
                 ["-arch=compute_80", "-code=sm_80,sm_90"],
                 ["--gpu-architecture", "compute_80", "--gpu-code", "compute_80,sm_86"],
                 ["-gencode", "arch=compute_80,code=[sm_80,compute_80]"],
                 ["-gencode=arch=compute_80,code=\"sm_80,sm_86\""],
                 ["--generate-code", "arch=compute_89,code=sm_89", "-gencode",
                  "arch=compute_90,code=compute_90"]]
        with tempfile.TemporaryDirectory() as tmp:
            with open(os.path.join(tmp, "k.cu"), "w") as handle:
                handle.write("__global__ void k() {}\n")

            def dryrun(flags):
                done = subprocess.run(["nvcc", "--dryrun"] + flags + ["-c", "k.cu", "-o", "k.o"],
                                      cwd=tmp, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                      universal_newlines=True)
                images = re.findall(r"--image3=kind=(elf|ptx),sm=(\w+)", done.stdout)
                return (done.returncode, sorted({sm for kind, sm in images if kind == "elf"}),
                        sorted({sm for kind, sm in images if kind == "ptx"}))

            for flags in forms:
                with self.subTest(flags=flags):
                    call = self.call("nvcc", *flags)
                    self.assertEqual(dryrun(flags), (0, sorted(set(call.sass)), sorted(set(call.ptx))))
                    self.assertEqual(call.unknown, [])
            # nvcc refuses a bare list after code= in -gencode; the reader says it cannot read it.
            flags = ["-gencode", "arch=compute_80,code=sm_80,sm_86"]
            self.assertNotEqual(dryrun(flags)[0], 0)
            self.assertEqual(self.call("nvcc", *flags).unknown, [
                "-gencode arch=compute_80,code=sm_80,sm_86, which nvcc does not read (a list of "
                "codes is written code=[sm_80,sm_90])"])
            # all, all-major and native build a list that depends on nvcc's
            # version and the GPU of the machine: no fixed list.
            for arch in ("all", "all-major", "native"):
                with self.subTest(arch=arch):
                    code, sass, _ = dryrun(["-arch=" + arch])
                    self.assertEqual(code, 0)
                    self.assertTrue(sass)
                    call = self.call("nvcc", "-arch=" + arch)
                    self.assertEqual((call.sass, call.open_targets), ([], ["-arch=" + arch]))

    @unittest.skipUnless(shutil.which("nvcc"), "nvcc is not installed, so its refusals cannot be "
                                                "compared")
    def test_nvcc_refusals_and_modes_are_what_nvcc_dryrun_does(self):
        # Each form against the real nvcc: whether `nvcc --dryrun` refuses it,
        # and the machine code (ptxas) and PTX (cicc) it would build.
        forms = [["-gencode", "arch=compute_90,code=sm_89"], ["-gencode", "arch=compute_80,code=sm_90"],
                 ["-gencode", "arch=compute_90a,code=sm_90"], ["-gencode", "arch=compute_90,code=sm_90a"],
                 ["-gencode", "arch=compute_90a,code=sm_100a"], ["-gencode", "arch=compute_100f,code=sm_100f"],
                 ["-gencode", "arch=compute_100f,code=sm_103f"], ["-gencode", "arch=compute_100f,code=sm_110f"],
                 ["-gencode", "arch=compute_100a,code=sm_100f"], ["-gencode", "arch=compute_100,code=sm_100f"],
                 ["-gencode", "arch=compute_90,code=compute_89"], ["-gencode", "arch=compute_90,code=compute_90a"],
                 ["-gencode", "arch=compute_90,code=sm90"], ["-gencode", "arch=compute90,code=sm_90"],
                 ["-gencode", "arch=sm_90,code=sm_90"], ["-arch=sm90"], ["-arch=compute90"],
                 ["-arch=sm_90", "-code=sm_90"], ["-arch=compute_90", "-code=sm_89"], ["-arch=sm_90a"],
                 ["-arch=sm_100f"], ["-ptx", "-arch=sm_80"], ["-ptx", "-gencode", "arch=compute_80,code=sm_80"],
                 ["-cubin", "-arch=sm_80"], ["-fatbin", "-arch=sm_80"], ["-E", "-arch=sm_80"],
                 ["-M", "-arch=sm_80"], ["-arch=sm_80,sm_90"]]
        with tempfile.TemporaryDirectory() as tmp:
            with open(os.path.join(tmp, "k.cu"), "w") as handle:
                handle.write("__global__ void k() {}\n")
            for flags in forms:
                with self.subTest(flags=flags):
                    done = subprocess.run(["nvcc", "--dryrun"] + flags + ["-c", "k.cu", "-o", "k.o"],
                                          cwd=tmp, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                          universal_newlines=True)
                    sass = sorted(set(re.findall(r"--image3=kind=elf,sm=(\w+)", done.stdout) or
                                      re.findall(r"ptxas\"? .*-arch=sm_(\w+)", done.stdout)))
                    ptx = set(re.findall(r"cicc\"? .*-arch compute_(\w+)", done.stdout))
                    call = self.call("nvcc", *flags)
                    self.assertEqual((done.returncode != 0, bool(call.rejected)), (bool(call.rejected),) * 2,
                                     done.stdout[-300:])
                    if done.returncode == 0:
                        self.assertEqual(sass, sorted(set(call.sass)))
                        self.assertLessEqual(set(call.ptx), ptx | set(call.sass))
        self.assertEqual(self.call("nvcc", "-gencode", "arch=compute_90,code=sm_89").rejected, [
            "-gencode arch=compute_90,code=sm_89: nvcc refuses it (incompatible code generation: "
            "sm_89 cannot be built from compute_90); write arch=compute_89,code=sm_89"])
        self.assertEqual(self.call("nvcc", "-gencode", "arch=compute_90,code=sm90").rejected, [
            "-gencode arch=compute_90,code=sm90: nvcc knows no target sm90; write sm_90"])
        self.assertEqual(self.call("nvcc", "-arch=sm_90", "-code=sm_90").rejected, [
            "-arch=sm_90 with -code: nvcc takes a virtual architecture there; write -arch=compute_90"])

    def test_the_last_march_counts_and_probes_build_nothing(self):
        self.assertEqual(self.call("gcc", "-march=x86-64-v3", "-march=x86-64", "-shared").targets("cpu"),
                         ["x86-64"])
        self.assertEqual(self.call("gcc", "-mcpu=neoverse-v1", "-shared").targets("cpu"), ["neoverse-v1"])
        self.assertEqual(self.call("gcc", "-mcpu=power9", "-march=x", "-shared").targets("cpu"), ["x"])
        for probe in (["-E"], ["-fsyntax-only"], ["-M"], ["-MM"], ["-o", "/dev/null"]):
            with self.subTest(probe=probe):
                self.assertEqual(self.call("gcc", "-march=znver4", "k.c", *probe).targets("cpu"), [])
        self.assertEqual(self.call("gcc", "-march=znver4", "-MD", "-c", "k.c").targets("cpu"), ["znver4"])

    def test_hip_and_cpu_targets(self):
        call = self.call("hipcc", "--offload-arch=gfx90a:xnack+,gfx942", "--offload-arch", "gfx1100",
                         "--amdgpu-target=gfx908", "-c", "k.hip")
        self.assertEqual(call.hip, ["gfx90a:xnack+", "gfx942", "gfx1100", "gfx908"])
        self.assertEqual(self.call("amdclang++", "-mcpu=gfx11-generic", "-c", "k.cpp").hip,
                         ["gfx11-generic"])
        self.assertEqual(self.call("hipcc", "--genco", "--targets", "gfx900,gfx906", "k.hip").hip,
                         ["gfx900", "gfx906"])
        self.assertEqual(self.call("hipcc", "--targets", "gfx900").hip, [])  # not with --genco
        self.assertEqual(self.call("clang++", "--offload-arch=native").open_targets,
                         ["--offload-arch=native"])
        self.assertEqual(self.call("gcc-12", "-march=znver4", "-shared").march, ["znver4"])

    def test_abi_version_defines(self):
        call = self.call("nvcc", "-DQWEN_ABI_VERSION=6", "-D", "X_ABI_VERSION=7", "-DOTHER=1")
        self.assertEqual(call.abi_defines, [("QWEN", "6"), ("X", "7")])

    def test_words_of_an_argument_not_passed_are_not_read(self):
        not_reached = check_contract.NOT_REACHED
        call = self.call("nvcc", "-arch=sm_" + not_reached, "-o", not_reached + "/l.so")
        self.assertEqual((call.sass, call.outputs), ([], []))


class ScriptReaderTest(TreeTest):
    """The build-script reader follows what `./build.sh <output-dir>` runs."""

    def cuda(self, script, architectures=(80,), default_arch=None, **extra):
        """A cuda backend `fat` whose build.sh is `script` (after its #! line)."""
        files = fat_files(architectures=list(architectures), default_arch=default_arch or
                          architectures[0])
        files["backends/cuda/fat/build.sh"] = Executable("#!/usr/bin/env bash\n" + script)
        files.update(("backends/cuda/fat/" + path, content) for path, content in extra.items())
        self.tree(files)

    def read(self, script):
        facts = check_contract.ScriptReader(script).facts()
        return ([show(o) for call in facts.calls for o in call.outputs],
                [arch for call in facts.calls for arch in call.sass], facts.default_target)

    def test_one_line_if_and_an_unresolved_compiler_word(self):
        # The script shape of the issue's CUDA backend: after then/else on
        # one line, and $(command -v nvcc) replacing the empty NVCC.
        self.cuda('nvcc=${NVCC:-}\nif [ -z "$nvcc" ]; then\n'
                  '  if [ -n "${CUDA_HOME:-}" ]; then nvcc=$CUDA_HOME/bin/nvcc; else nvcc=$(command -v nvcc); fi\n'
                  'fi\narch=${2:-80}\n'
                  '"$nvcc" -O3 -shared -gencode "arch=compute_${arch},code=[sm_${arch},compute_${arch}]" '
                  'ops.cu -o "$1/libfat.so"\n')
        self.assertClean()

    def test_an_unknown_value_replaces_a_known_one(self):
        self.cuda('arch=80\narch=$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader)\n'
                  'nvcc -shared -arch=sm_$arch ops.cu -o "$1/libfat.so"\n')
        self.assertIssue("B017", "cannot tell whether build.sh builds 80: -arch=sm_$(nvidia-smi "
                         "--query-gpu=compute_cap --format=csv,noheader) at line 4", "warning")

    def test_backticks_are_a_value_computed_when_the_script_runs(self):
        self.cuda('TOP=`pwd`\nnvcc -shared -arch=sm_80 ops.cu -o "$TOP/libfat.so"\n')
        self.assertIssue("B013", "build script build.sh writes its library to `pwd`/libfat.so, not "
                         "under its <output-dir> argument ($1): the build tier and CI look for "
                         "libfat.so in <output-dir>; write -o \"$1/libfat.so\"")

    def test_parameter_expansions(self):
        self.assertEqual(self.read(
            'src=ops.cu\nout=$1/\nname=libfat.so.1\nv=sm_80\n'
            'nvcc -arch=${v/sm/sm} -c $src -o "${out%/}/${src%.cu}.o"\n'
            'nvcc -arch=${v#sm_} -o "${out%%/}/${name%.*}"\n'
            ': "${ARCH:=90}"\nnvcc -arch=sm_$ARCH -o "${OUT:-$1}/${ARCH_NAME:=lib}.so"\n'),
            (["$1/ops.o", "$1/libfat.so", "$1/lib.so"], ["80", "90"], None))

    def test_an_ampersand_in_a_replacement_cannot_be_told(self):
        # bash 5.2 puts the matched text where & is; older bash writes &.
        self.assertEqual(self.read('v=libk\nnvcc -arch=sm_80 -o "$1/${v/k/&x}.so"\n')[0], ["$1/${.../k/&x}.so"])

    def test_required_variable_cannot_be_told(self):
        self.cuda('nvcc -shared -arch=sm_${CUDA_ARCH:?set CUDA_ARCH} ops.cu -o "$1/libfat.so"\n')
        self.assertIssue("B017", "cannot tell whether build.sh builds 80: -arch=sm_${CUDA_ARCH:?set "
                         "CUDA_ARCH} (the script stops unless it is set) at line 2", "warning")

    def test_colon_default_assignment(self):
        self.tree(demo_files(**{"backends/cpu/demo/build.sh": Executable(
            '#!/bin/sh\nmkdir -p "$1"\n: "${MARCH:=x86-64}"\ncc -shared -march="$MARCH" ops.c -o "$1/libdemo.so"\n')}))
        self.assertClean()

    def test_shift_before_the_target_argument(self):
        self.assertEqual(self.read('out=$1\nshift\narch=${1:-90}\n'
                                   'nvcc -arch=sm_$arch -o "$out/l.so"\n'), (["$1/l.so"], ["90"], "90"))

    def test_a_shift_on_one_branch_leaves_the_arguments_undecided(self):
        self.assertEqual(self.read('if [ -f /etc/x ]; then shift; fi\nnvcc -arch=sm_80 -o "$1/l.so"\n')[0],
                         ["$1 (if [ -f /etc/x ] at line 1)/l.so"])

    def test_one_line_if_on_the_argument_count(self):
        self.assertEqual(self.read('if [ $# -ge 2 ]; then m=$2; else m=89; fi\n'
                                   'nvcc -arch=sm_$m -o "$1/l.so"\n'), (["$1/l.so"], ["89"], None))

    def test_here_document_bodies_are_not_commands(self):
        self.assertEqual(self.read('cat > k.cu <<EOF\nnvcc -arch=sm_70 -o "$1/wrong.so"\nEOF\n'
                                   'cat <<-"END"\n\tnvcc -o x\n\tEND\n'
                                   'nvcc -arch=sm_80 -o "$1/l.so"\n'), (["$1/l.so"], ["80"], None))

    def test_a_sourced_file_in_the_backend_is_read(self):
        self.cuda('source "$(dirname "$0")/arch.env"\ncd "$(dirname "$0")"\n. ./arch.env\n'
                  'nvcc -shared -arch=sm_$ARCH ops.cu -o "$1/libfat.so"\n',
                  **{"arch.env": "ARCH=80\n"})
        self.assertClean()
        # Where the script is in a folder, its $(dirname "$0") is that folder; a relative
        # name before any cd is relative to the directory it is run from.
        files = fat_files(script="tools/build.sh", architectures=[80], default_arch=80)
        files.update({"backends/cuda/fat/tools/build.sh": Executable(
            '#!/usr/bin/env bash\nhere=$(cd "$(dirname "$0")" && pwd)\nsource "$here/arch.env"\n'
            'nvcc -shared -arch=sm_$ARCH "$here/../ops.cu" -o "$1/libfat.so"\n'),
            "backends/cuda/fat/tools/arch.env": "ARCH=80\n", "backends/cuda/fat/arch.env": "ARCH=90\n"})
        self.tree(files)
        self.assertClean()
        # Not read: a name relative to where the script runs, a bare name (bash looks in PATH
        # first), a path through a folder that is not there, and any from a script that is a
        # link (its $(realpath "$0") is the target's folder).
        for lines, shown in (('. ./arch.env', '. ./arch.env'), ('cd "$(dirname "$0")"\n. arch.env', '. arch.env'),
                             ('. "$(dirname "$0")/nosuch/../arch.env"', '. $(dirname "$0")/nosuch/../arch.env')):
            with self.subTest(lines=lines):
                self.cuda(lines + '\nnvcc -shared -arch=sm_${ARCH:-80} ops.cu -o "$1/libfat.so"\n',
                          **{"arch.env": "ARCH=90\n"})
                self.assertIssue("B017", "cannot tell whether build.sh builds only what the checker reads; the "
                                 "checker does not follow line %d (%s, which is no file in the backend "
                                 "directory)" % (lines.count("\n") + 2, shown), "warning")
        files = fat_files(architectures=[80], default_arch=80)
        files.update({"backends/cuda/fat/tools/build.sh": Executable(
            '#!/usr/bin/env bash\nsource "$(dirname "$(realpath "$0")")/arch.env"\n'
            'nvcc -shared -arch=sm_$ARCH ops.cu -o "$1/libfat.so"\n'),
            "backends/cuda/fat/tools/arch.env": "ARCH=80\n", "backends/cuda/fat/arch.env": "ARCH=90\n"})
        self.tree(files)
        os.remove(self.path("backends/cuda/fat/build.sh"))
        os.symlink("tools/build.sh", self.path("backends/cuda/fat/build.sh"))
        self.assertNotIn("B006", self.check()[1])
        self.cuda('. /etc/arch.env\nnvcc -shared -arch=sm_${ARCH:-70} ops.cu -o "$1/libfat.so"\n')
        self.assertIssue("B017", "cannot tell whether build.sh builds 80: no target flag names it; "
                         "the checker does not follow line 2 (. /etc/arch.env, which is no file in "
                         "the backend directory)", "warning")

    def test_the_branch_the_default_invocation_takes(self):
        self.assertEqual(self.read(
            'if [ -z "${CUDA_ARCH:-}" ]; then\n  a=89\nelse\n  a=$CUDA_ARCH\nfi\n'
            'if [ -n "$NVCC_FLAGS" ]; then b=70; elif command -v nvcc >/dev/null; then b=90; else b=75; fi\n'
            'case "${2:-}" in\n  "") c=80 ;;\n  *) c=$2 ;;\nesac\n'
            'case "$GPU" in 70|75) d=70;; esac\n'
            'nvcc -arch=sm_$a -arch=sm_$b -gencode arch=compute_$c,code=sm_$c -o "$1/l.so"\n'),
            (["$1/l.so"], ["80", "90"], None))

    def test_an_undecidable_condition_makes_the_value_one_of_its_branches(self):
        self.cuda('if [ -d /usr/local/cuda-12 ]; then a=80; else a=90; fi\n'
                  'nvcc -shared -arch=sm_$a ops.cu -o "$1/libfat.so"\n')
        self.assertIssue("B017", "cannot tell whether build.sh builds 80: -arch=sm_$a (if [ -d "
                         "/usr/local/cuda-12 ] at line 2) at line 3", "warning")

    def test_an_output_that_depends_on_the_second_argument_is_not_the_default_one(self):
        self.assertEqual(self.read('nvcc -arch=sm_80 -o "$1/l.so"\nnvcc -arch=sm_$2 -o "$2/other.so"\n'
                                   'if [ -n "${2:-}" ]; then nvcc -arch=sm_$2 -o "$1/l_$2.so"; fi\n'),
                         (["$1/l.so"], ["80"], None))

    def test_functions_wrappers_and_loops_are_followed(self):
        self.cuda('run() { echo "+ $*"; "$@"; }\n'
                  'build() {\n  local arch=$1\n  flags+=(-gencode arch=compute_$arch,code=sm_$arch)\n}\n'
                  'flags=()\nfor a in 80 89; do build $a; done\n'
                  'for a in 90; do\n  build "$a"\ndone\n'
                  'run nvcc -shared "${flags[@]}" ops.cu -o "$1/libfat.so"\n',
                  architectures=(80, 89, 90))
        self.assertClean()

    def test_word_splitting_of_an_unquoted_variable(self):
        self.assertEqual(self.read('FLAGS="-gencode arch=compute_80,code=sm_80 -O3"\n'
                                   'nvcc $FLAGS -o "$1/l.so"\nnvcc "$FLAGS" -o "$1/m.so"\n'),
                         (["$1/l.so", "$1/m.so"], ["80"], None))

    def test_export_local_and_a_while_loop_over_the_arguments(self):
        self.assertEqual(self.read(
            'export OUT=$1\nwhile [ $# -gt 0 ]; do\n  case $1 in\n    -v) set -x;;\n  esac\n  shift\n'
            'done\nf() { local OUT=elsewhere; }\nf\nnvcc -arch=sm_80 -o "$OUT/l.so"\n'),
            (["$1/l.so"], ["80"], None))

    def test_what_the_reader_does_not_follow_makes_it_say_it_cannot_tell(self):
        for script, unfollowed in (
                ('eval "nvcc -arch=sm_80 -o $1/libfat.so"\n', "line 2 (eval)"),
                ('while true; do :; done\n', "line 2 (a while loop that runs more than 256 times)"),
                ('[[ $x =~ (a|b) ]]\n', "line 2 (( out of place)")):
            with self.subTest(script=script):
                self.cuda(script)
                self.assertIssue("B017", "cannot tell which library build.sh writes: it has no "
                                 "compiler command with -o that the checker can see; the checker "
                                 "does not follow " + unfollowed, "warning")

    def test_values_that_keep_doubling_are_given_up(self):
        # Read, not run: v+=$v forty times would be a value of 2**41 characters.
        for doubling in ('v=ab\n' + 'v+=$v\n' * 40, 'a=(x y)\n' + 'a=("${a[@]}" "${a[@]}")\n' * 40):
            with self.subTest(script=doubling[:12]):
                reader = check_contract.ScriptReader(
                    doubling + 'cc -march=x86-64 -o "$1/libdemo.so" -DV="$v" "${a[@]}"\n')
                self.assertEqual([c.outputs for c in reader.calls], [[check_contract.OUT_DIR + "/libdemo.so"]])
                self.assertLessEqual(max(len(v) for v in reader.vars.values() or [""]), 1 << 16)

    def test_relative_outputs_follow_cd(self):
        self.assertEqual(self.read('mkdir -p "$1"\ncd "$1"\nnvcc -arch=sm_80 -o libl.so k.cu\n'
                                   'pushd obj\nnvcc -c ../k.cu -o k.o\npopd\n'),
                         (["$1/libl.so", "$1/obj/k.o"], ["80"], None))
        self.cuda('cd "$(dirname "$0")"\nnvcc -shared -arch=sm_80 ops.cu -o build/libfat.so\n')
        self.assertIssue("B013", "build script build.sh writes its library to $(dirname "
                         "\"$0\")/build/libfat.so, not under its <output-dir> argument ($1): the "
                         "build tier and CI look for libfat.so in <output-dir>; write -o "
                         "\"$1/libfat.so\"")

    def test_deeply_nested_text_is_not_followed_and_no_traceback(self):
        for text in ("(" * 5000, "{ " * 3000, "if true; then " * 2000, "x=${" * 2000, "a=(" * 2000,
                     '"$(' * 2000):
            with self.subTest(text=text[:8]):
                self.assertEqual(check_contract.ScriptReader(text).unfollowed,
                                 [(1, "shell text nested deeper than it reads")])

    def test_bounded_work_on_loops_and_recursion(self):
        reader = check_contract.ScriptReader('f() { f; }\nf\nfor a in 1 2 3 4 5 6 7 8 9 10; do\n'
                                             '  for b in 1 2 3 4 5 6 7 8 9 10; do\n'
                                             '    for c in 1 2 3 4 5 6 7 8 9 10; do\n'
                                             '      for d in 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20 21; do :; done\n'
                                             '    done\n  done\ndone\n')
        self.assertEqual([what for line, what in reader.unfollowed],
                         ["functions nested deeper than 32 calls", "more than 20000 commands to follow"])

class PositionalParametersTest(TreeTest):
    """`set -- ARGS` gives the script new positional parameters: $1 is the
    first word after `--`, which is not one of them."""

    def test_set_with_a_double_dash_resets_the_parameters_to_what_follows_it(self):
        facts = check_contract.ScriptReader(
            'set -- "$1" 90\nnvcc -shared -arch=sm_$2 ops.cu -o "$1/libfat.so"\n').facts()
        self.assertEqual(([show(o) for call in facts.calls for o in call.outputs],
                          [arch for call in facts.calls for arch in call.sass]),
                         (["$1/libfat.so"], ["90"]))

    def test_a_script_that_sets_its_target_with_set_is_clean(self):
        files = fat_files(architectures=[90], default_arch=90)
        files["backends/cuda/fat/build.sh"] = Executable(
            '#!/usr/bin/env bash\nset -- "$1" 90\nmkdir -p "$1"\nnvcc -O3 -shared -arch=sm_$2 ops.cu -o "$1/libfat.so"\n')
        self.tree(files)
        self.assertClean()

    def test_set_without_a_double_dash_keeps_the_parameters(self):
        facts = check_contract.ScriptReader(
            'set -eux\nnvcc -shared -arch=sm_${2:-80} ops.cu -o "$1/libfat.so"\n').facts()
        self.assertEqual([show(o) for call in facts.calls for o in call.outputs], ["$1/libfat.so"])


class ReaderTableTest(unittest.TestCase):
    def test_every_construct_the_reader_reads_names_a_test_that_exists(self):
        with open(os.path.join(os.path.dirname(os.path.abspath(__file__)), "docs",
                               "check_contract.md")) as handle:
            text = handle.read()
        section = text[text.index("## What the script reader reads"):]
        section = section[:section.index("\n## ", 1)]
        rows = [line for line in section.splitlines() if line.startswith("| ") and "---" not in line
                and not line.startswith(("| Construct", "| Expansion", "| Compiler flag"))]
        self.assertGreaterEqual(len(rows), 35)
        corpus = {entry[0] for entry in BUILD_SCRIPT_CORPUS}
        for row in rows:
            with self.subTest(row=row[:40]):
                test = row.rstrip(" |").rsplit("| ", 1)[-1]
                named = re.match(r"`(\w+)\.(\w+)`\Z|`CorpusTest` \(`(\w+)`\)\Z", test)
                self.assertIsNotNone(named, test)
                if named.group(3):
                    self.assertIn(named.group(3), corpus)
                else:
                    self.assertTrue(hasattr(globals()[named.group(1)], named.group(2)), test)


class CompiledSourcesTest(TreeTest):
    """trace compares every file a compiler compiled with `sources`; check
    does so for the files the reading surely compiles."""

    def files(self, sources, excluded=None, script=None, compiles=""):
        manifest = {"name": "k", "abi_version": 1, "status": "experimental", "sources": sources,
                    "build": {"script": "build.sh", "output": "libk.so", "architectures": [80]}}
        if excluded is not None:
            manifest["excluded"] = excluded
        if script is None:
            script = ('cd "$(dirname "$0")"\nprintf "" > "$1/gen.cu"\n'
                      'nvcc -shared -arch=sm_80 -o "$1/libk.so" "$1/gen.cu" %s\n' % compiles)
        return {"backends/cuda/k/k.backend.json": manifest,
                "backends/cuda/k/k.h": "#define K_ABI_VERSION 1\nunsigned k_abi_version(void);\n"
                                       "const char* k_error_string(int code);\n",
                "backends/cuda/k/k.cu": "", "backends/cuda/k/old.cu": "",
                "backends/cuda/k/test_k.cu": "", "backends/common/util.cu": "",
                "backends/cuda/k/build.sh": Executable('#!/usr/bin/env bash\nset -eu\nmkdir -p "$1"\n' + script)}

    def traced(self, compiles, sources, excluded=None):
        self.tree(self.files(sources, excluded, compiles=compiles))
        rc, out, err = self.check("trace", "--format", "json")
        return [(i["level"], i["code"], i["path"], i["message"])
                for i in json.loads(out)["results"][0]["issues"]]

    def checked(self, script, sources=("k.h", "k.cu"), excluded=("old.cu",), links=()):
        """check's (exit status, findings) for a build.sh: the lines after mkdir -p "$1"."""
        files = self.files(list(sources), list(excluded), script=script)
        files["common/util.cu"] = files.pop("backends/common/util.cu")
        self.tree(files)
        for path, target in links:
            os.symlink(target, self.path(path))
        rc, issues = self.issues()
        return rc, [(i["level"], i["code"], i["path"], i["message"][:70]) for i in issues]

    def test_check_reports_an_undeclared_file_the_script_compiles_from_its_directory(self):
        for place in ('cd "$(dirname "$0")"\n', 'cd "$(cd "$(dirname "$0")" && pwd)"\n',
                      'cd "$(dirname "$(realpath "$0")")"\n', 'cd "$(dirname "$0")/../../.."\ncd backends/cuda/k\n'):
            with self.subTest(place=place):
                self.assertEqual(self.checked(
                    place + 'nvcc -shared -arch=sm_80 -o "$1/libk.so" k.cu test_k.cu ../../../common/util.cu\n'), (1, [
                        ("error", "S008", "backends/cuda/k/test_k.cu",
                         "build.sh compiles backends/cuda/k/test_k.cu, which sources does not de"),
                        ("error", "S008", "common/util.cu",
                         "build.sh compiles common/util.cu, outside the backend directory, where")]))

    def test_check_reads_a_relative_name_from_the_repository_root_where_the_script_runs(self):
        self.assertEqual(self.checked('nvcc -shared -arch=sm_80 -o "$1/libk.so" backends/cuda/k/k.cu '
                                      'backends/cuda/k/old.cu\n', ["k.h", "k.cu", "test_k.cu"]), (1, [
            ("error", "S008", "backends/cuda/k/old.cu",
             "build.sh compiles backends/cuda/k/old.cu, which excluded says is not p"),
            ("warning", "S009", "backends/cuda/k/test_k.cu",
             "sources declares test_k.cu, but no compiler call of build.sh compiles ")]))

    def test_check_reports_a_compiled_file_that_nothing_can_make(self):
        # A substitution whose output goes to /dev/null or another descriptor makes no file.
        for place in ('cd "$(dirname "$0")"\n', 'cd "$(cd "$(dirname "$0")" >/dev/null 2>&1 && pwd)"\n',
                      'cd "$(cd -- "$(dirname -- "$0")" &> /dev/null; pwd)"\n',
                      'cd "$(cd "$(dirname "$0")" 2>&- >&2 && pwd)"\n'):
            with self.subTest(place=place):
                self.assertEqual(self.checked(place + 'nvcc -shared -arch=sm_80 -o "$1/libk.so" '
                                              'k.cu missing.cu\n'), (1, [
                    ("error", "S008", "backends/cuda/k/missing.cu",
                     "build.sh compiles backends/cuda/k/missing.cu, which is no file (the re")]))

    def test_check_says_no_s009_where_a_program_it_does_not_know_is_given_the_file(self):
        # mpicxx, Ascend's bisheng, zig: compilers by another name (a real script ran bisheng).
        for unknown in ("mpicxx", "bisheng --cce-aicore-arch=dav-c220", "zig c++"):
            with self.subTest(unknown=unknown):
                rc, found = self.checked('here=$(dirname "$0")\n%s -shared -o "$1/libk2.so" "$here/test_k.cu"\n'
                                         'nvcc -shared -arch=sm_80 -o "$1/libk.so" "$here/k.cu"\n' % unknown,
                                         ["k.h", "k.cu", "test_k.cu"])
                self.assertEqual([f for f in found if f[1] in ("S008", "S009")], [])
        rc, found = self.checked('cd "$(dirname "$0")"\ncp k.cu copy.cu && sed -i s/a/b/ copy.cu\n'
                                 'nvcc -shared -arch=sm_80 -o "$1/libk.so" k.cu\n', ["k.h", "k.cu", "test_k.cu"])
        self.assertEqual([f[1] for f in found if f[1] in ("S008", "S009")], ["S009"])  # cp and sed compile nothing

    def test_a_file_included_by_an_option_is_not_compiled(self):
        for option in ("-include", "--pre-include", "-Xcompiler -imacros"):
            with self.subTest(option=option):
                self.assertEqual(self.checked('cd "$(dirname "$0")"\nnvcc -shared -arch=sm_80 -o "$1/libk.so" '
                                              'k.cu %s old.cu\n' % option), (0, []))

    def test_a_file_only_probed_is_not_compiled(self):
        for probe in ("-E old.cu", "-fsyntax-only old.cu", "-M old.cu", "-c old.cu -o /dev/null"):
            with self.subTest(probe=probe):
                self.assertEqual(self.checked('cd "$(dirname "$0")"\nnvcc %s\nnvcc -shared -arch=sm_80 -o '
                                              '"$1/libk.so" k.cu\n' % probe, ["k.h", "k.cu", "test_k.cu"]), (0, [
                    ("warning", "S009", "backends/cuda/k/test_k.cu",
                     "sources declares test_k.cu, but no compiler call of build.sh compiles ")]))

    def test_check_says_nothing_certain_of_a_file_the_script_may_make_first(self):
        for making in ('python3 gen.py\n', 'cp k.cu missing.cu\n', 'cat > missing.cu <<EOF\nEOF\n',
                       'x=$(python3 gen.py)\n', 'make\n', 'eval "$(echo true)"\n', 'f() { cp k.cu missing.cu; }\nf\n',
                       'x=$(echo > missing.cu)\n', 'x=$(cd . >& missing.cu && pwd)\n'):
            with self.subTest(making=making):
                rc, found = self.checked('cd "$(dirname "$0")"\n' + making + 'nvcc -shared -arch=sm_80 '
                                         '-o "$1/libk.so" k.cu missing.cu\n')
                self.assertEqual([f for f in found if f[0] == "error"], [])

    def test_check_places_each_file_where_bash_compiles_it(self):
        """Each file S008 names is one bash compiles when the build tier runs
        the script (by its path, from the repository root); stub compilers log it."""
        scripts = {
            'cd "$(dirname "$0")"\nnvcc -o "$1/libk.so" k.cu test_k.cu\n': {"k.cu", "test_k.cu"},
            'cd "$(dirname "$0")"\n(cd .. && nvcc -c k/old.cu -o "$1/a.o")\nnvcc -o "$1/libk.so" '
            'test_k.cu\n': {"old.cu", "test_k.cu"},
            'd=$(cd "$(dirname "$0")/.." && pwd)\ncd "$d"\nnvcc -o "$1/libk.so" k/k.cu k/test_k.cu\n':
                {"k.cu", "test_k.cu"},
            'pushd "$(dirname "$0")" >/dev/null\npushd .. >/dev/null\npopd >/dev/null\n'
            'nvcc -o "$1/libk.so" k.cu\n': {"k.cu"},
            'nvcc -o "$1/libk.so" backends/cuda/k/k.cu ../outside.cu\n': {"k.cu"},
            'f() { cd "$(dirname "$0")"; }\nf\nnvcc -o "$1/libk.so" missing.cu || true\n': {"missing.cu"},
            'cd /\ncd "$(dirname "$(realpath "$0")")"/../../..\nnvcc -o "$1/libk.so" common/util.cu\n':
                {"common/util.cu"},
            # The script's directory held in a variable, as real scripts name their files.
            'here=$(dirname "$0")\nnvcc -o "$1/libk.so" "$here/k.cu" "$here"/test_k.cu\n': {"k.cu", "test_k.cu"},
            'here="$(dirname "${BASH_SOURCE[0]}")"\nnvcc -o "$1/libk.so" "$here/test_k.cu"\n': {"test_k.cu"},
            'here=$( cd -- "$( dirname -- "${BASH_SOURCE[0]}" )" &> /dev/null && pwd )\n'
            'nvcc -o "$1/libk.so" "$here/k.cu" "$here/../../../common/util.cu"\n': {"k.cu", "common/util.cu"},
            'here="$(cd "$(dirname "$BASH_SOURCE")" >/dev/null 2>&1; pwd -P)"\nnvcc -o "$1/libk.so" '
            '"${here}/old.cu"\n': {"old.cu"},
            'cd "$(dirname "$0")"/..\nup=$PWD\ncd k\nhere=$(pwd)\ncd /\nnvcc -o "$1/libk.so" "$here/k.cu" '
            '"$up/k/test_k.cu"\n': {"k.cu", "test_k.cu"},
            # A cd into a folder that is not there fails: bash stays where it was.
            'cd "$(dirname "$0")"\ncd nosuch || true\nnvcc -o "$1/libk.so" k.cu\n': set(),
            'cd "$(dirname "$0")"\nmkdir -p sub\ncd sub\nnvcc -o "$1/libk.so" ../test_k.cu\n': {"test_k.cu"},
            # A folder that is not there: the compiler cannot open nosuch/../test_k.cu.
            'cd "$(dirname "$0")"\nnvcc -o "$1/libk.so" k.cu nosuch/../test_k.cu\n': {"k.cu"},
            # After unset PWD, $PWD is no longer the reader's to know.
            'cd "$(dirname "$0")"\nunset PWD\nset +u\nnvcc -o "$1/libk.so" "$PWD/test_k.cu" k.cu\n': {"k.cu"},
            # A cd on one branch only: where the call runs cannot be told.
            'cd "$(dirname "$0")"\n[ -d sub ] && cd sub\nnvcc -o "$1/libk.so" test_k.cu "$PWD/k.cu"\n': set()}
        bin_dir = tempfile.mkdtemp(prefix="check-contract-bin-")
        self.addCleanup(shutil.rmtree, bin_dir, True)
        with open(os.path.join(bin_dir, "nvcc"), "w") as handle:
            handle.write(BASH_STUB.replace("|| exit 1", "|| true"))
        os.chmod(os.path.join(bin_dir, "nvcc"), 0o755)
        for script, expected in scripts.items():
            with self.subTest(script=script):
                shutil.rmtree(self.root)
                rc, found = self.checked(script, ["k.h"], [])
                log = os.path.join(bin_dir, "log")
                subprocess.run([self.path("backends/cuda/k/build.sh"), self.path("out")], cwd=self.root,
                               env={"PATH": bin_dir + ":/usr/bin:/bin", "STUB_LOG": log}, check=True)
                with open(log) as handle:
                    records = handle.read().split("\1\0")[:-1]
                os.remove(log)
                root = os.path.realpath(self.root)
                compiled = {os.path.relpath(os.path.join(pwd, arg), root).replace("backends/cuda/k/", "")
                            for pwd, _, *argv in (r.split("\0")[:-1] for r in records)
                            for arg in argv if arg.endswith(".cu")}
                self.assertEqual({path.replace("backends/cuda/k/", "") for _, code, path, _ in found
                                  if code == "S008"}, expected)
                self.assertLessEqual(expected, compiled)

    def test_bash_source_names_the_script_only_where_bash_runs_it(self):
        script = '\nhere="$(dirname "${BASH_SOURCE[0]}")"\nnvcc -shared -o "$1/libk.so" "$here/k.cu"\n'
        for shebang, read in (("#!/usr/bin/env bash", True), ("#!/bin/bash -e", True), ("#!/bin/sh", False)):
            with self.subTest(shebang=shebang):  # sh (dash) has no BASH_SOURCE: dirname "" is .
                facts = check_contract.ScriptReader(shebang + script).facts()
                self.assertEqual(bool(facts.script_dirs), read)

    def test_bash_source_in_a_sourced_file_names_that_file(self):
        # Also in a function that file defines, wherever it is called from.
        for env, uses in (('SUB="$(dirname "${BASH_SOURCE[0]}")"\n', ""),
                          ('where() { SUB="$(dirname "${BASH_SOURCE[0]}")"; }\n', "where\n")):
            with self.subTest(env=env):
                script = ('here="$(dirname "${BASH_SOURCE[0]}")"\nsource "$here/sub/env.sh"\n' + uses +
                          'nvcc -shared -arch=sm_80 -o "$1/libk.so" "$here/k.cu" "$SUB/test_k.cu"\n')
                files = self.files(["k.h", "k.cu", "sub/test_k.cu"], ["test_k.cu"], script=script)
                files["backends/cuda/k/sub/env.sh"] = env
                files["backends/cuda/k/sub/test_k.cu"] = ""
                self.tree(files)
                rc, issues = self.issues()
                self.assertEqual([(i["code"], i["path"]) for i in issues if i["code"] in ("S008", "S009")], [])

    def test_a_parent_reached_through_a_link_is_where_the_link_points(self):
        rc, found = self.checked('cd "$(dirname "$0")/sub"\nnvcc -shared -arch=sm_80 -o "$1/libk.so" '
                                 '../k.cu ../test_k.cu || true\n', links=[("backends/cuda/k/sub", "../../../common")])
        self.assertEqual([f for f in found if f[1] == "S008"], [])  # bash compiles common/../*.cu

    def test_a_file_in_a_linked_directory_is_where_the_link_points(self):
        for place in ("", 'cd "$(dirname "$0")"\n'):
            with self.subTest(place=place):
                rc, found = self.checked(place + 'nvcc -shared -arch=sm_80 -o "$1/libk.so" %sk.cu %ssub/util.cu\n' % (
                    ("", "") if place else ("backends/cuda/k/", "backends/cuda/k/")),
                    links=[("backends/cuda/k/sub", "../../../common")])
                self.assertEqual([f for f in found if f[1] == "S008"], [])  # bash compiles common/util.cu
                os.unlink(self.path("backends/cuda/k/sub"))

    def test_check_leaves_a_directory_it_cannot_tell_alone(self):
        for place in ('X=$0\nX=/elsewhere/build.sh\ncd "$(dirname "$X")"\n', 'cd "$(dirname "$PWD")"\n',
                      'if [ -f x ]; then cd "$(dirname "$0")"; fi\n'):
            with self.subTest(place=place):
                self.assertEqual(self.checked(place + 'nvcc -shared -arch=sm_80 -o "$1/libk.so" k.cu test_k.cu\n'),
                                 (0, []))

    def test_what_is_compiled_but_not_declared_is_an_error(self):
        self.assertEqual(self.traced("k.cu test_k.cu old.cu ../../common/util.cu",
                                     ["k.h", "k.cu"], excluded=["old.cu"]), [
            ("error", "S008", "backends/common/util.cu", "running build.sh <output-dir> shows: "
             "build.sh compiles backends/common/util.cu, outside the backend directory, where the "
             "check does not look; move it into backends/cuda/k, or build it as a backend of its own"),
            ("error", "S008", "backends/cuda/k/old.cu", "running build.sh <output-dir> shows: build.sh "
             "compiles backends/cuda/k/old.cu, which excluded says is not part of the library; "
             "remove it from excluded and declare it"),
            ("error", "S008", "backends/cuda/k/test_k.cu", "running build.sh <output-dir> shows: "
             "build.sh compiles backends/cuda/k/test_k.cu, which sources does not declare; add it")])

    def test_a_declared_source_nothing_compiles_is_a_warning(self):
        self.assertEqual(self.traced("k.cu", ["k.h", "k.cu", "old.cu", "test_k.cu"]), [
            ("warning", "S009", "backends/cuda/k/old.cu", "running build.sh <output-dir> shows: "
             "sources declares old.cu, but no compiler call of build.sh compiles it (a file only "
             "#included by another is a header: name it so, or list it in excluded)"),
            ("warning", "S009", "backends/cuda/k/test_k.cu", "running build.sh <output-dir> shows: "
             "sources declares test_k.cu, but no compiler call of build.sh compiles it (a file only "
             "#included by another is a header: name it so, or list it in excluded)")])
        self.assertEqual(self.traced("k.cu old.cu test_k.cu", ["k.h", "k.cu", "old.cu", "test_k.cu"]), [])

    def test_a_compiled_file_that_does_not_exist_is_an_error(self):
        self.assertEqual(self.traced("k.cu missing.cu", ["k.h", "k.cu"]), [
            ("error", "S008", "backends/cuda/k/missing.cu", "running build.sh <output-dir> shows: "
             "build.sh compiles backends/cuda/k/missing.cu, which is no file (neither the repository "
             "nor the build has it), so the real compiler fails on it; correct the name, or add the "
             "file to backends/cuda/k and declare it")])


BASH_STUB = r"""#!/bin/sh
# A compiler that records where it runs and its argv, and writes the file -o
# names; nothing else.
printf '%s\0' "$PWD" "${0##*/}" "$@" >> "$STUB_LOG"
printf '\1\0' >> "$STUB_LOG"
next=
for arg in "$@"; do
    if [ "$next" = o ]; then : > "$arg" || exit 1; fi
    next=
    case $arg in -o) next=o ;; -o?*) [ "${0##*/}" = nvcc ] || { : > "${arg#-o}" || exit 1; } ;; esac
done
"""
BASH_STUB_NAMES = ("nvcc", "hipcc", "gcc", "g++", "cc", "c++", "clang", "clang++")


def run_in_bash(scripts, sourced=False):
    """What real bash does with each script run as `./script <output-dir>`
    from a directory of its own, every compiler a stub that records its
    argv: [(status, [CompilerCall of each compiler run], files in
    <output-dir> at the end)], the calls' paths as the reader spells them
    (<output-dir> as OUT_DIR, others relative to where the script ran).
    One bash runs them all; `sourced` runs each in a subshell of it
    (`. script`) rather than in a bash of its own, which is faster."""
    # Memory, where the machine has it: thousands of small files are made.
    memory = "/dev/shm" if os.access("/dev/shm", os.W_OK) else None
    with tempfile.TemporaryDirectory(prefix="check-contract-bash-", dir=memory) as top:
        os.mkdir(os.path.join(top, "bin"))
        for name in BASH_STUB_NAMES:
            with open(os.path.join(top, "bin", name), "w") as handle:
                handle.write(BASH_STUB)
            os.chmod(os.path.join(top, "bin", name), 0o755)
        for index, script in enumerate(scripts):
            for sub in ("w", "o"):
                os.makedirs(os.path.join(top, sub, str(index)))
            with open(os.path.join(top, "w", "%d.sh" % index), "w") as handle:
                handle.write(script)
        run = ('set -- "$T/o/$n"; . ../$n.sh' if sourced else 'exec bash ../$n.sh "$T/o/$n"')
        driver = ('for n in $(seq $0 $1 %d); do\n'
                  '  (cd w/$n && export STUB_LOG=$T/log.$n && %s) </dev/null >/dev/null 2>&1\n'
                  '  echo $? > status.$n\ndone\n' % (len(scripts) - 1, run))
        env = {"PATH": os.path.join(top, "bin") + ":/usr/bin:/bin", "T": top, "LC_ALL": "C", "HOME": top}
        jobs = min(os.cpu_count() or 1, 4)  # one bash per processor, each every jobs-th script
        drivers = [subprocess.Popen(["bash", "-c", driver, str(job), str(jobs)], cwd=top, env=env)
                   for job in range(jobs)]
        assert [driver.wait() for driver in drivers] == [0] * jobs
        statuses = []
        for index in range(len(scripts)):
            with open(os.path.join(top, "status.%d" % index)) as handle:
                statuses.append(int(handle.read()))
        results = []
        for index, status in enumerate(statuses):
            out, work = os.path.join(top, "o", str(index)), os.path.join(top, "w", str(index))
            try:
                with open(os.path.join(top, "log.%d" % index), "rb") as handle:
                    log = handle.read().decode("utf-8", "surrogateescape")
            except FileNotFoundError:
                log = ""
            calls = []
            for record in log.split("\1\0")[:-1]:
                cwd, *argv = [arg.replace(out, check_contract.OUT_DIR) for arg in record.split("\0")[:-1]]
                cwd = None if cwd == work else cwd if cwd.startswith(check_contract.OUT_DIR) else (
                    os.path.relpath(cwd, work))
                calls.append(check_contract.compiler_call(argv, cwd=cwd))
            landed = set()
            for directory, dirs, files in os.walk(out):
                landed.update(os.path.relpath(os.path.join(directory, f), out) for f in files + [
                    d for d in dirs if os.path.islink(os.path.join(directory, d))])
            results.append((status, calls, landed))
        return results


# A differential test of the script reader against bash: scripts generated
# (seeded, so every run makes the same ones) from the shell constructs real
# build scripts use, and some the reader does not follow; each is run by real
# bash with stub compilers, and every certain answer of the reader must be
# what bash did.

DIFF_ARCHES = ("70", "75", "80", "86", "89", "90")


class ScriptGenerator:
    """One build script per call of script(): a few statements that set
    targets, run compilers in assorted ways and move the library around."""

    def __init__(self, seed):
        self.rng = random.Random(seed)

    def script(self):
        self.names, self.lines, self.arches, self.libs = 0, [], [], []
        self.lines.append(self.pick(["#!/usr/bin/env bash", "#!/bin/bash", "#!/usr/bin/env bash\nset -euo pipefail",
                                     "#!/bin/bash\nset -e", "#!/usr/bin/env bash\nset -u"]))
        self.lines.append(self.pick(['out=$1', 'out="${1:?usage: build.sh <output-dir>}"',
                                     'out=$(cd "$1" && pwd)', 'out=$1; shift', 'out=$1']))
        self.one = "$1" if "shift" not in self.lines[-1] else "$out"
        self.lines.append('mkdir -p build "$out"')
        for _ in range(self.rng.randint(1, 4)):
            self.pick([self.arch, self.arch, self.compile, self.compile, self.compile, self.place,
                       self.control, self.unknown, self.fails, self.rare])()
        self.compile()
        if self.rng.random() < 0.4:
            self.place()
        return "\n".join(self.lines) + "\n"

    def pick(self, items):
        return self.rng.choice(items)

    def name(self, prefix):
        self.names += 1
        return "%s%d" % (prefix, self.names)

    def target(self):
        return "$" + self.pick(self.arches) if self.arches and self.rng.random() < 0.7 else self.pick(DIFF_ARCHES)

    def arch(self):
        a, x = self.name("a"), self.pick(DIFF_ARCHES)
        self.lines.append(self.pick([
            '%s=${2:-%s}' % (a, x), '%s=%s' % (a, x), '%s="${ARCH_%s:-%s}"' % (a, a, x),
            '%s=$((%s / 2 * 2))' % (a, x), "%s=$'\\x%02x'%s" % (a, ord(x[0]), x[1]),
            "printf -v %s '%%s' %s" % (a, x), ': "${%s:=%s}"' % (a, x), '%s=%s0; %s=${%s%%0}' % (a, x, a, a),
            'if [ $# -ge 2 ]; then %s=$2; else %s=%s; fi' % (a, a, x),
            'case "${2:-}" in\n  "") %s=%s ;;\n  *) %s=$2 ;;\nesac' % (a, x, a),
            '%s=$(echo %s)' % (a, x), 'read -r %s <<< %s' % (a, x),
            'if [ -d /nonexistent-%s ]; then %s=70; else %s=%s; fi' % (a, a, a, x),
            '%s=%s\n[ "$%s" = %s ] && %s=75' % (a, x, a, x, a),
            'shopt -s lastpipe\ntrue | { %s=%s; }' % (a, x), 'true | { %s=%s; }' % (a, x),
            '%s=({%s,%s})' % (a, x, self.pick(DIFF_ARCHES))]))
        self.arches.append(a)

    def flags(self):
        t = self.target()
        return self.pick(['-arch=sm_%s' % t, '-gencode arch=compute_%s,code=sm_%s' % (t, t),
                          '-gencode "arch=compute_%s,code=[sm_%s,compute_%s]"' % (t, t, t),
                          '-gencode=arch=compute_{80,90},code=sm_{80,90}',
                          "$'-arch=sm_%s'" % t if t[0] != "$" else '-arch=sm_"%s"' % t])

    def compiler(self):
        return self.pick(["nvcc", "nvcc", "command nvcc", '"${NVCC:-nvcc}"', "env CCACHE_DISABLE=1 nvcc",
                          "timeout 600 nvcc", "nice -n 5 nvcc"])

    def compile(self):
        kind = self.rng.random()
        lib = self.name("lib") + ".so"
        out = self.pick(['"$out/%s"' % lib, '"%s/%s"' % (self.one, lib), '"$out"/%s' % lib, 'build/%s' % lib])
        if kind < 0.15:
            line = 'hipcc -shared -fPIC --offload-arch=%s ops.hip -o %s' % (
                self.pick(["gfx90a", "gfx942", "gfx1100"]), out)
        elif kind < 0.25:
            line = '%s -shared -fPIC -march=%s ops.c -o %s' % (
                self.pick(["gcc", "cc", "clang"]), self.pick(["x86-64", "x86-64-v3", "native"]), out)
        else:
            line = '%s -shared -Xcompiler -fPIC %s %s -o %s' % (self.compiler(), self.flags(),
                                                               self.pick(["ops.cu", "k.cu"]), out)
        if out.startswith("build/"):
            self.lines.append(line)
            self.lines.append(self.pick(['cp build/%s "$out/"' % lib, 'mv build/%s "%s/%s"' % (lib, self.one, lib),
                                         'install -m 755 build/%s "$out/%s"' % (lib, lib)]))
        elif self.wrap(line):
            self.libs.append(lib)

    def wrap(self, line):
        """Run the compiler line in some construct; whether it has run after it."""
        f, v = self.name("f"), self.name("v")
        inside = line.replace('"$1/', '"$out/')  # a function's $1 is its own
        later = ['trap \'%s\' EXIT' % line.replace("'", "'\\''"),
                 'cat <<EOF >/dev/null\n%s\nEOF' % line, '# %s' % line]
        wrapped = self.pick(later + [
            line, line, 'if true; then\n  %s\nfi' % line, '[ -n "$out" ] && %s' % line,
            'false || %s' % line, '%s() {\n  %s\n}\n%s' % (f, inside, f),
            '%s() { "$@"; }\n%s %s' % (f, f, line),
            'for %s in 1; do %s; done' % (v, line), '{ %s; }' % line, '( %s )' % line,
            '%s=0\nwhile [ $%s -lt 1 ]; do\n  %s\n  %s=$((%s + 1))\ndone' % (v, v, line, v, v),
            'shopt -s expand_aliases\nalias %s="%s"\n%s' % (f, line.split(" -o ")[0], f + " -o " + line.split(" -o ")[1]),
            '%s \\\n    -O3' % line])
        self.lines.append(wrapped)
        return wrapped not in later

    def place(self):
        if not self.libs:
            return
        lib, new = self.pick(self.libs), self.name("lib") + ".so"
        moved = ['mv "$out/%s" "$out/%s"' % (lib, new), 'mv "%s"/%s "$out/%s"' % (self.one, lib, new),
                 '[ -f "$out/%s" ] && mv "$out/%s" "$out/%s"' % (lib, lib, new)]
        copied = ['cp "%s/%s" "%s/%s"' % (self.one, lib, self.one, new), 'ln -sf %s "$out/%s"' % (lib, new)]
        gone = ['rm -f "$out/%s"' % lib, 'mv "$out"/%s{,.bak}' % lib]
        line = self.pick(moved + copied + gone + ["trap 'rm -f \"$out/%s\"' EXIT" % lib])
        self.lines.append(line)
        if line in moved + gone:
            self.libs.remove(lib)
        if line in moved + copied:
            self.libs.append(new)

    def control(self):
        v = self.name("v")
        self.lines.append(self.pick([
            'for %s in {80,90} 86; do nvcc -c -arch=sm_$%s k.cu -o build/k$%s.o; done' % (v, v, v),
            'for %s in $(seq 2); do nvcc -c k.cu -o build/s$%s.o; done' % (v, v),
            'case x in x) nvcc -c -arch=sm_70 k.cu -o build/c.o ;& y) %s=1 ;; esac' % v,
            '%s=(k.cu ops.cu)\nfor s in "${%s[@]}"; do nvcc -c "$s" -o "build/${s%%.cu}.o"; done' % (v, v),
            'set -- "$out" 89\n%s=${2:-80}' % v, 'pushd build >/dev/null\nnvcc -c ../k.cu -o p.o\npopd >/dev/null',
            '(cd build && nvcc -c ../k.cu -o sub.o)', 'cd build\nnvcc -c ../k.cu -o cd.o\ncd ..']))

    def unknown(self):
        self.lines.append(self.pick([
            'eval "nvcc -c k.cu -o build/e.o"', 'x=$(nvcc -c k.cu -o build/x.o 2>&1)',
            'bash -c "nvcc -c k.cu -o build/b.o"', 'make -s -f /dev/null 2>/dev/null || true',
            '. ./missing.sh 2>/dev/null || true', 'if [ -f k.cu ]; then nvcc -c k.cu -o build/f.o; fi',
            'nvcc --version >/dev/null || true', 'while read -r line; do :; done < <(echo x)',
            "trap 'nvcc -c k.cu -o build/t.o' ERR"]))

    def rare(self):
        """Constructs few scripts use, where a reader is easily wrong."""
        self.lines.append(self.pick([
            'shopt -s nocasematch\ncase X in x) r=90 ;; *) r=80 ;; esac\nnvcc -c -arch=sm_$r k.cu -o build/n.o',
            'x=ab\n[[ $x =~ ^a ]] && r=90 || r=80\nnvcc -c -arch=sm_$r k.cu -o build/r.o',
            'declare -n ref=ARCHV\nARCHV=90\nnvcc -c -arch=sm_$ref k.cu -o build/ref.o',
            'name=ARCHW\nARCHW=86\nnvcc -c -arch=sm_${!name} k.cu -o build/ind.o',
            'arr=(70 80)\nnvcc -c -arch=sm_${arr[1]} -arch=sm_${arr[-1]} k.cu -o build/a.o',
            'IFS=, read -r a b <<< "80,90"\nnvcc -c -arch=sm_$b k.cu -o build/ifs.o',
            'x="-arch=sm_80 -O3"\nIFS=:\nnvcc -c $x k.cu -o build/ifs2.o\nunset IFS',
            'shopt -s extglob\ncase 90 in @(80|90)) e=90 ;; *) e=70 ;; esac\nnvcc -c -arch=sm_$e k.cu -o build/eg.o',
            'a=80; (( a += 10 )); nvcc -c -arch=sm_$a k.cu -o build/ar.o',
            'a="80 90"; for x in $a; do nvcc -c -arch=sm_$x k.cu -o build/l$x.o; done',
            'until [ -n "${u:-}" ]; do u=90; done\nnvcc -c -arch=sm_$u k.cu -o build/u.o',
            'x=$(( 0x50 ))\nnvcc -c -arch=sm_$x k.cu -o build/hex.o',
            'x=080\nnvcc -c -arch=sm_$((x)) k.cu -o build/oct.o || true']))

    def fails(self):
        self.lines.append(self.pick([
            'set -e\nfalse', 'set -e\n( exit 1 )', 'set -u\nx=$2', 'set -u\nx=$UNSET_FLAGS',
            'set -e\nfalse || true', 'set -u\nx=${2:-}', 'if [ -z "$out" ]; then exit 1; fi',
            'exit 0', 'set -e\n[ -n "${2:-}" ]', 'set -e\nf() { return 1; }\nf || true',
            'set -e\ntrue && false', 'set -e\nfalse && true', '(( 0 )) || true']))


def reader_answers(script):
    """The reader's certain answers about a script: None when it says it
    cannot tell, else (whether it surely fails, its compiler calls or None
    where it cannot tell them, the files surely in <output-dir> or None)."""
    facts = check_contract.ScriptReader(script).facts()
    if facts.unfollowed:
        return None
    known = check_contract.known
    calls = [call_answer(call) for call in facts.calls]
    if any(call.condition or call.unknown or not all(map(known, call.outputs + call.inputs))
           for call in facts.calls):
        calls = None
    landed, maybe = facts.landing()
    if maybe or any(condition or path is None for _, path, _, condition in facts.placements):
        landed = None
    if calls is None and landed is None and facts.death is None:
        return None
    return facts.death is not None, calls, landed


def call_answer(call):
    norm = posixpath.normpath
    return (call.compiler, [norm(o) for o in call.outputs], call.sass, call.ptx, call.hip,
            call.march, call.open_targets, [norm(i) for i in call.inputs])


def differential(scripts, sourced=True):
    """(count of scripts the reader and bash agree on, of those it cannot
    tell, [(script, what bash did, what the reader read)] where they differ)."""
    agree, cannot, differ = 0, 0, []
    for script, (status, calls, landed) in zip(scripts, run_in_bash(scripts, sourced)):
        answer = reader_answers(script)
        if answer is None:
            cannot += 1
            continue
        dies, read_calls, read_landed = answer
        ran = [call_answer(call) for call in calls]
        if (dies and status == 0) or (read_calls is not None and read_calls != ran) or (
                read_landed is not None and not dies and read_landed != landed):
            differ.append((script, (status, ran, landed), answer))
        else:
            agree += 1
    return agree, cannot, differ

class DifferentialReaderTest(unittest.TestCase):
    """The reader against bash on generated scripts: every certain answer
    (the compiler calls with their outputs, targets and compiled files, the
    files left in <output-dir>, a default run that surely fails) is what
    bash did.  bench/differential_reader.py runs more of them."""

    SCRIPTS = 2000

    def test_every_certain_answer_is_what_bash_does(self):
        generator = ScriptGenerator(seed=37)
        scripts = [generator.script() for _ in range(self.SCRIPTS)]
        agree, cannot, differ = differential(scripts)
        self.assertEqual(differ[:3], [], "%d of %d scripts read otherwise than bash runs them"
                         % (len(differ), len(scripts)))
        self.assertEqual(agree + cannot, self.SCRIPTS)
        self.assertGreater(agree, 3 * cannot)  # most scripts get certain answers to check
        self.assertGreater(cannot, 0)  # and the constructs it does not follow are among them

    def test_the_scripts_are_the_same_every_run(self):
        first, second = ScriptGenerator(seed=1), ScriptGenerator(seed=1)
        self.assertEqual([first.script() for _ in range(50)], [second.script() for _ in range(50)])


class ReaderAgreesWithBashTest(TreeTest):
    """Each construct is read as real bash runs it (bash runs the script with
    stub compilers that log their argv), or said to be what the reader
    cannot tell; never a certain answer bash contradicts."""

    def agree(self, script):
        """Bash's and the reader's (outputs, targets, files left in
        <output-dir>) for the script; the reader follows all of it."""
        (status, calls, landed), = run_in_bash([script])
        facts = check_contract.ScriptReader(script).facts()
        self.assertEqual((facts.unfollowed, facts.death), ([], None))
        read = [(call.outputs, call.targets("cuda")) for call in facts.calls]
        ran = [(call.outputs, call.targets("cuda")) for call in calls]
        self.assertEqual((status, read, facts.landing()[0]), (0, ran, landed))
        return ran, landed

    def test_bash_source_is_the_script_not_an_empty_value(self):
        self.agree('set -e\n[ -n "${BASH_SOURCE[0]}" ] || exit 1\nmkdir -p "$1"\n'
                   'nvcc -c -arch=sm_80 k.cu -o "$1/a.o"\n')

    def test_brace_expansion(self):
        ran, landed = self.agree('nvcc -shared -arch=sm_80 -o "$1"/libfat_tmp.so ops.cu\n'
                                 'mv "$1"/libfat{_tmp,}.so\n'
                                 'for a in {8..9}0 "{7,8}"; do nvcc -c -arch=sm_$a ops.cu -o k.o; done\n')
        self.assertEqual((ran[1:], landed), ([(["k.o"], ["80"]), (["k.o"], ["90"]), (["k.o"], [])],
                                             {"libfat.so"}))
        self.cuda_fat('mkdir -p "$1"\nnvcc -shared -arch=sm_80 -o "$1"/libfat_tmp.so ops.cu\n'
                      'mv "$1"/libfat{_tmp,}.so\n')
        self.assertClean()

    def test_an_array_is_transformed_element_by_element_and_anchors_hold(self):
        ran, landed = self.agree('archs=(80 90)\nfor a in "${archs[@]/#/sm_}"; do nvcc -c -arch=$a k.cu -o "$1/k_$a.o"; done\n'
                                 'srcs=(a.cu b.cu)\nfor o in ${srcs[*]%.cu}; do nvcc -c -arch=sm_80 $o.cu -o "$1/$o.o"; done\n'
                                 'v=xlibk\nnvcc -shared -arch=sm_90 -o "$1/${v/#x/}${v/%k/}${v/#l/L}${v^^}.so" k.cu\n')
        self.assertEqual(landed, {"k_sm_80.o", "k_sm_90.o", "a.o", "b.o", "libkxlibxlibkXLIBK.so"})

    def test_array_slices_defaults_and_joins_are_elements(self):
        ran, landed = self.agree('srcs=(old.cu k.cu t.cu)\nfor s in "${srcs[@]:1}" "${srcs[@]:0:1}"; do '
                                 'nvcc -c -arch=sm_80 $s -o "$1/${s%.cu}.o"; done\n'
                                 'for s in "${srcs[@]:-none}"; do nvcc -c -arch=sm_80 $s -o "$1/d_${s%.cu}.o"; done\n'
                                 'IFS=,\nnvcc -shared -arch=sm_90 -o "$1/lib${srcs[*]}.so" k.cu\n')
        self.assertEqual(landed, {"k.o", "t.o", "old.o", "d_old.o", "d_k.o", "d_t.o", "libold.cu,k.cu,t.cu.so"})

    def test_ansi_c_quoting(self):
        ran, landed = self.agree("flags=$'-arch=sm_80\\t-O3'\nnvcc -shared $flags -o \"$1\"/$'lib\\x66at.so' "
                                 "ops.cu\necho $'it\\'s'\n")
        self.assertEqual((ran, landed), ([(["\x02/libfat.so"], ["80"])], {"libfat.so"}))

    def test_lastpipe_runs_the_last_command_of_a_pipeline_in_the_shell(self):
        ran, landed = self.agree('shopt -s lastpipe\narch=80\necho | { arch=90; }\n'
                                 'nvcc -shared -arch=sm_$arch -o "$1/libfat.so" ops.cu\n')
        self.assertEqual(ran, [(["\x02/libfat.so"], ["90"])])
        ran, landed = self.agree('arch=80\necho | { arch=90; }\nnvcc -shared -arch=sm_$arch -o "$1/l.so" ops.cu\n')
        self.assertEqual(ran, [(["\x02/l.so"], ["80"])])

    def test_an_exit_trap_runs_when_the_script_ends(self):
        ran, landed = self.agree("trap 'rm -f \"$1/libfat.so\"' EXIT\n"
                                 'nvcc -shared -arch=sm_80 -o "$1/libfat.so" ops.cu\n')
        self.assertEqual(landed, set())
        ran, landed = self.agree('trap "nvcc -shared -arch=sm_90 -o $1/libfat.so ops.cu" EXIT\n'
                                 'trap - INT\nnvcc -shared -arch=sm_80 -o "$1/libfat.so" ops.cu\n')
        self.assertEqual(ran[1][1], ["90"])
        self.agree('( trap \'nvcc -c -arch=sm_90 ops.cu -o k.o\' EXIT; true )\n'
                   'nvcc -shared -arch=sm_80 -o "$1/libfat.so" ops.cu\n')
        self.cuda_fat('mkdir -p "$1"\ntrap \'rm -f "$1/libfat.so"\' EXIT\n'
                      'nvcc -shared -arch=sm_80 -o "$1/libfat.so" ops.cu\n')
        self.assertIssue("B013", "build script build.sh writes libfat.so with -o, but it is not in "
                         "<output-dir> when the script ends (moved or removed after); leave "
                         "build.output there")

    def test_a_default_run_that_surely_fails_is_b019(self):
        for script, line, why in (
                ('set -u\narch=$2\n', 3, "set -u stops the script at $2, which the default "
                 "invocation does not pass"),
                ('set -eu\nnvcc=$NVCC\n', 3, "set -u stops the script at $NVCC, which is unset (the "
                 "default invocation sets no optional variable)"),
                ('set -e\nfalse\n', 3, "set -e stops the script where false fails"),
                ('set -euo pipefail\n( exit 1 )\n', 3, "set -e stops the script where ( exit 1 ) fails"),
                ('set -o errexit\nf() { return 3; }\nf\n', 4, "set -e stops the script where f fails"),
                ('exit 2\n', 2, "exit 2")):
            with self.subTest(script=script):
                (status, argvs, landed), = run_in_bash([script + 'nvcc -shared -arch=sm_80 -o "$1/l.so" k.cu\n'])
                self.assertNotEqual(status, 0)
                self.assertEqual(argvs, [])
                self.cuda_fat('mkdir -p "$1"\n' + script + 'nvcc -shared -arch=sm_80 -o "$1/libfat.so" ops.cu\n')
                rc, issues = self.issues()
                self.assertEqual([(i["code"], i["line"], i["message"]) for i in issues],
                                 [("B019", line + 1, "build.sh <output-dir> fails at line %d: %s, before "
                                   "any compiler command with -o; the build tier and CI would fail "
                                   "there" % (line + 1, why))])
        for script in ('set -e\nfalse || true\nfalse && true\n! false\nif false; then :; fi\n'
                       'f() { false; echo; }\nf || true\nwhile false; do :; done\nfalse | true\n',
                       'set -u\narch=${2:-80}\n: "${NVCC:=nvcc}" "$@" "${a[@]}"\nx=$HOME$BASH_VERSION\n'
                       'if [ $# -ge 2 ]; then arch=$2; fi\nf() { local y=1; echo $y; }\nf\n',
                       'set -u\nset +u\nx=$2\nset -e\nset +o errexit\nfalse\n'):
            with self.subTest(script=script):
                self.agree(script + 'nvcc -shared -arch=sm_80 -o "$1/libfat.so" ops.cu\n')

    def test_command_and_builtin_skip_functions(self):
        ran, landed = self.agree('nvcc() { command nvcc -Xcompiler -fPIC "$@"; }\n'
                                 'nvcc -shared -arch=sm_80 -o "$1/libfat.so" ops.cu\n'
                                 'builtin nvcc -shared -arch=sm_90 -o "$1/x.so" ops.cu || true\n')
        self.assertEqual(ran, [(["\x02/libfat.so"], ["80"])])

    def test_process_substitution_is_a_word(self):
        self.agree('while read -r f; do :; done < <(ls)\ncat <(echo x) >/dev/null\n'
                   'nvcc -shared -arch=sm_80 -o "$1/libfat.so" ops.cu\n')
        facts = check_contract.ScriptReader('cat < <(nvcc -shared -arch=sm_90 -o "$1/l.so" k.cu)\n').facts()
        self.assertEqual(facts.unfollowed, [(1, 'a compiler run inside <(nvcc -shared -arch=sm_90 -o "$1/l.so" k.cu)')])
        facts = check_contract.ScriptReader('x=$(nvcc -shared -arch=sm_90 -o "$1/l.so" k.cu 2>&1)\n').facts()
        self.assertEqual(facts.unfollowed, [(1, 'a compiler run inside $(nvcc -shared -arch=sm_90 -o "$1/l.so" k.cu 2>&1)')])

    def test_aliases_with_expand_aliases(self):
        ran, landed = self.agree("shopt -s expand_aliases\nalias nvcc='nvcc -gencode arch=compute_90,code=sm_90'\n"
                                 'nvcc -shared -arch=sm_80 -o "$1/libfat.so" ops.cu\n')
        self.assertEqual(ran, [(["\x02/libfat.so"], ["90", "80"])])
        ran, landed = self.agree("alias nvcc='nvcc -gencode arch=compute_90,code=sm_90'\n"
                                 'nvcc -shared -arch=sm_80 -o "$1/libfat.so" ops.cu\n')
        self.assertEqual(ran, [(["\x02/libfat.so"], ["80"])])

    def test_what_is_not_followed_is_b017_naming_the_line(self):
        for script, line, what in (
                ("bash -s \"$1\" <<'SH'\nrm -f \"$1/libfat.so\"\nSH\n", 4, 'bash -s, a program whose commands it does not read'),
                ("eval 'rm -f \"$1/libfat.so\"'\n", 4, "eval"),
                ("trap 'rm -f \"$1/libfat.so\"' ERR\n", 4, "the command of trap ... ERR")):
            with self.subTest(script=script):
                (status, argvs, landed), = run_in_bash(['nvcc -shared -arch=sm_80 -o "$1/libfat.so" ops.cu\n'
                                                        + script + "false\n"])
                self.assertEqual(landed, set())
                self.cuda_fat('mkdir -p "$1"\nnvcc -shared -arch=sm_80 -o "$1/libfat.so" ops.cu\n' + script)
                rc, issues = self.issues()
                self.assertEqual([(i["code"], i["line"], i["message"]) for i in issues],
                                 [("B017", line, "cannot tell whether build.sh builds only what the "
                                   "checker reads; the checker does not follow line %d (%s)" % (line, what))])

    def test_a_library_link_that_dangles_is_b013_read_and_traced(self):
        for script, link, why in (
                ('mkdir -p "$1" build\nnvcc -shared -arch=sm_80 -o build/libfat.so ops.cu\n'
                 'ln -sf build/libfat.so "$1/libfat.so"\n', "build/libfat.so",
                 " (a relative link is read from the directory it is in, <output-dir>)"),
                ('mkdir -p "$1"\ntmp=$(mktemp -d)\nnvcc -shared -arch=sm_80 -o "$tmp/libfat.so" ops.cu\n'
                 'ln -sf "$tmp/libfat.so" "$1/libfat.so"\nrm -rf "$tmp"\n', "$(mktemp -d)/libfat.so", "")):
            with self.subTest(script=script):
                (status, calls, landed), = run_in_bash(['cd "$(dirname "$0")"\n' + script + '[ -e "$1/libfat.so" ]\n'])
                self.assertEqual((status, landed), (1, {"libfat.so"}))  # a link, to nothing
                self.cuda_fat('cd "$(dirname "$0")"\n' + script)
                message = ("leaves libfat.so in <output-dir> as a link to %s, which is not there when "
                           "the script ends%s; link to a file in <output-dir>, or copy the library there")
                self.assertIssue("B013", "build.sh " + message % (link, why))
                rc, out, err = self.check("trace", "--format", "json")
                self.assertEqual([(i["code"], re.sub(r"tmp\.\w+", "tmp.X", i["message"]))
                                  for i in json.loads(out)["results"][0]["issues"]],
                                 [("B013", "running build.sh <output-dir> %sshows: build.sh " % run + message % (
                                     link.replace("$(mktemp -d)", "$TMPDIR/tmp.X"), why)) for run in ("80 ", "")])

    def test_a_script_that_never_creates_its_output_directory_is_b019(self):
        self.cuda_fat('cd "$(dirname "$0")"\nnvcc -shared -arch=sm_80 -o "$1/libfat.so" ops.cu\n')
        rc, issues = self.issues()
        self.assertEqual([(i["code"], i["line"], i["message"]) for i in issues], [
            ("B019", 3, 'build.sh <output-dir> fails at line 3: nvcc cannot write $1/libfat.so: nothing '
             'before it creates <output-dir>, and the build tier and CI pass one that does not exist '
             'yet; add mkdir -p "$1"')])
        self.cuda_fat('cd "$(dirname "$0")"\n[ -d "$1" ] || mkdir -p "$1"\n'
                      'nvcc -shared -arch=sm_80 -o "$1/libfat.so" ops.cu\n')
        self.assertClean()

    def test_eval_before_the_compiler_line_is_named_a_program_is_not(self):
        (status, calls, landed), = run_in_bash(['arch=80\neval "arch=90"\nnvcc -shared -arch=sm_$arch -o "$1/l.so" k.cu\n'])
        self.assertEqual(calls[0].sass, ["90"])  # what the reader cannot see
        self.cuda_fat('mkdir -p "$1"\narch=80\neval "arch=90"\nnvcc -shared -arch=sm_$arch -o "$1/libfat.so" ops.cu\n',
                      architectures=(90,))
        self.assertEqual(self.codes(), ["B017"])
        self.cuda_fat('mkdir -p "$1"\nmake -C "$(dirname "$0")" objects\n'
                      'nvcc -shared -arch=sm_80 -o "$1/libfat.so" ops.cu\n')
        self.assertClean()

    def test_nocasematch_ifs_and_a_number_bash_refuses(self):
        ran, landed = self.agree('shopt -s nocasematch\ncase X in x) a=90 ;; *) a=80 ;; esac\n'
                                 '[[ ABC == abc ]] && b=86 || b=75\n'
                                 'nvcc -shared -arch=sm_$a -arch=sm_$b -o "$1/libfat.so" ops.cu\n')
        self.assertEqual(ran, [(["\x02/libfat.so"], ["86"])])  # nvcc takes the last -arch
        (status, calls, landed), = run_in_bash(['x="-arch=sm_80 -O3"\nIFS=:\nnvcc -shared $x -o "$1/l.so" k.cu\n'])
        self.assertEqual(calls[0].sass, [])  # one word: -arch=sm_80 -O3
        call, = check_contract.ScriptReader('x="-arch=sm_80 -O3"\nIFS=:\nnvcc -shared $x -o "$1/l.so" k.cu\n').facts().calls
        self.assertEqual((call.sass, call.unknown), ([], ["-arch=sm_80 -O3 (split at IFS=':')"]))
        (status, calls, landed), = run_in_bash(['x=080\necho $((x + 1)); nvcc -shared -o "$1/a.so" k.cu\n'
                                                'nvcc -shared -o "$1/l.so" k.cu\n'])
        self.assertEqual([c.outputs for c in calls], [["\x02/l.so"]])  # bash drops the rest of the line
        self.assertEqual(check_contract.ScriptReader('x=080\necho $((x + 1))\n').facts().unfollowed,
                         [(2, "$((x + 1)), where 080 is no number bash takes (a leading 0 makes it octal)")])

    def test_a_move_of_a_file_that_is_not_there_moves_nothing(self):
        ran, landed = self.agree('mv "$1/none.so" "$1/l.so" || true\ncp "$1"/none.so "$1/m.so" || true\n'
                                 'nvcc -shared -arch=sm_80 -o "$1/libfat.so" ops.cu\n')
        self.assertEqual(landed, {"libfat.so"})

    def test_a_compiler_wrapped_in_a_function_of_its_name_is_read(self):
        self.cuda_fat('mkdir -p "$1"\nnvcc() { command nvcc -Xcompiler -fPIC "$@"; }\n'
                      'nvcc -shared -arch=sm_80 -o "$1/libfat.so" ops.cu\n')
        self.assertClean()

    def cuda_fat(self, script, architectures=(80,)):
        files = fat_files(architectures=list(architectures), default_arch=architectures[0])
        files["backends/cuda/fat/build.sh"] = Executable("#!/usr/bin/env bash\n" + script)
        self.tree(files)


class ReaderHonestyTest(TreeTest):
    """Constructs the reader once read as certain and wrong: each is read as
    bash runs it, or said to be what the reader cannot tell."""

    def read(self, script):
        facts = check_contract.ScriptReader(script).facts()
        return ([show(o) for call in facts.calls for o in call.outputs],
                [arch for call in facts.calls for arch in call.sass], facts.unfollowed)

    def test_assignments_in_a_pipeline_stay_in_its_subshell(self):
        self.assertEqual(self.read('configure() { arch=90; }\narch=80\nconfigure | tee log\n'
                                   'nvcc -arch=sm_$arch -o "$1/l.so"\n'), (["$1/l.so"], ["80"], []))

    def test_a_function_defined_on_both_branches_is_each_definition(self):
        self.assertEqual(self.read(
            'out=$1\nif [ -d /opt/cuda-12 ]; then\n  f() { nvcc -arch=sm_80 -o "$out/l.so"; }\nelse\n'
            '  f() { nvcc -arch=sm_90 -o "$out/l.so"; }\nfi\nf\n'), (["$1/l.so", "$1/l.so"], ["80", "90"], []))
        self.cuda_fat('if [ -d /opt/cuda-12 ]; then\n  f() { a=80; }\nelse\n  f() { a=90; }\nfi\n'
                      'f\nnvcc -shared -arch=sm_$a ops.cu -o "$1/libfat.so"\n')
        self.assertIssue("B017", "cannot tell whether build.sh builds 80: -arch=sm_$a (if [ -d "
                         "/opt/cuda-12 ] at line 2) at line 8", "warning")

    def test_arithmetic_commands_are_evaluated_or_unknown(self):
        self.assertEqual(self.read('if (( 0 )); then a=90; else a=80; fi\n'
                                   'if (( a > 70 )); then b=86; fi\n'
                                   'nvcc -gencode arch=compute_$a,code=sm_$a -gencode arch=compute_$b,code=sm_$b '
                                   '-o "$1/l.so"\n'), (["$1/l.so"], ["80", "86"], []))
        for assigns in ('let "a = 1"\n', '((a++))\n', 'let a+=2\n'):
            with self.subTest(assigns=assigns):
                call, = check_contract.ScriptReader(
                    'a=80\n' + assigns + 'nvcc -arch=sm_$a -o "$1/l.so"\n').facts().calls
                self.assertEqual((call.sass, call.unknown),
                                 ([], ["-arch=sm_$a (assigned in arithmetic at line 2)"]))

    def test_an_arithmetic_for_loop_runs_an_untold_number_of_times(self):
        call, = check_contract.ScriptReader(
            'flags=""\nfor ((i = 0; i < 2; i++)); do\n  flags="$flags -arch=sm_8$i"\ndone\n'
            'if (( 1 && 2 )); then nvcc $flags -o "$1/l.so"; fi\n').facts().calls
        self.assertEqual((call.sass, call.unknown, call.condition),
                         ([], ["$flags (the for loop at line 2)"], None))

    def test_double_bracket_patterns_match_as_globs(self):
        self.assertEqual(self.read('x=90\nif [[ $x == 9* ]]; then a=90; else a=80; fi\n'
                                   'if [[ $x != 8? ]]; then b=86; fi\n'
                                   'nvcc -gencode arch=compute_$a,code=sm_$a -gencode arch=compute_$b,code=sm_$b '
                                   '-o "$1/l.so"\n'), (["$1/l.so"], ["90", "86"], []))
        call, = check_contract.ScriptReader('x=90\nif [[ $x == "9*" ]]; then a=90; else a=80; fi\n'
                                            'nvcc -arch=sm_$a -o "$1/l.so"\n').facts().calls
        self.assertEqual(call.unknown, ['-arch=sm_$a (if [[ $x == "9*" ]] at line 2)'])

    def test_argument_slices_and_printf_v(self):
        self.assertEqual(self.read('out=$1\nrun() { "${@:2}"; }\nprintf -v lib "lib%s.so" fat\n'
                                   'run label nvcc -arch=sm_80 -o "$out/$lib"\n'),
                         (["$1/libfat.so"], ["80"], []))
        call, = check_contract.ScriptReader('printf -v a "%d" 80\nnvcc -arch=sm_$a -o "$1/l.so"\n').facts().calls
        self.assertEqual(call.unknown, ["-arch=sm_$a (printf -v at line 1)"])

    def test_unset_of_an_array_element_makes_the_array_unknown(self):
        call, = check_contract.ScriptReader('a=(-arch=sm_80 -arch=sm_90)\nunset "a[1]"\n'
                                            'nvcc "${a[@]}" -o "$1/l.so"\n').facts().calls
        self.assertEqual((call.sass, call.unknown), ([], ["${a[@]} (after unset a[1])"]))

    def test_shift_after_getopts_keeps_the_output_directory(self):
        self.assertEqual(self.read('while getopts "va:" opt; do\n  case $opt in v) set -x ;; esac\ndone\n'
                                   'shift $((OPTIND-1))\nout=$1\nnvcc -arch=sm_80 -o "$out/l.so"\n'),
                         (["$1/l.so"], ["80"], []))
        call, = check_contract.ScriptReader('shift $(nproc)\nnvcc -arch=sm_80 -o "$1/l.so"\n').facts().calls
        self.assertEqual(show(call.outputs[0]), "the arguments after shift $(nproc)/l.so")

    def test_prefix_commands_are_read_through(self):
        for prefix in ("nice -n 19", "nice -5", "timeout 600", "timeout -s KILL 10m", "stdbuf -oL",
                       "env CCACHE_DIR=/tmp/c -u OMP", "time -p", "command -p", "exec", "nohup"):
            with self.subTest(prefix=prefix):
                self.assertEqual(self.read(prefix + ' nvcc -arch=sm_80 -o "$1/l.so"\n'),
                                 (["$1/l.so"], ["80"], []))
        self.assertEqual(self.read('env -C /tmp nvcc -arch=sm_80 -o "$1/l.so"\n'), ([], [], [(1, "env -C")]))

    def test_case_fall_through(self):
        reader = check_contract.ScriptReader('case 80 in 80) a=80 ;& 90) b=90 ;; *) c=70 ;; esac\n'
                                             'case 80 in 80) d=80 ;;& 90) e=90 ;; 8*) f=70 ;; esac\n')
        self.assertEqual(reader.vars, {"a": "80", "b": "90", "d": "80", "f": "70"})

    def test_a_copy_of_files_it_cannot_name_is_cannot_tell(self):
        for copy in ('cp build/* "$1/"', 'cp -r build/. "$1/"'):
            with self.subTest(copy=copy):
                facts = check_contract.ScriptReader(
                    'nvcc -arch=sm_80 -o build/libx.so k.cu\n' + copy + '\n').facts()
                self.assertEqual(facts.landing(), (set(), {
                    None: "line 2 puts a file there whose name the checker cannot tell"}))

    def test_a_case_with_too_many_ways_to_run_is_not_followed(self):
        # Each ;;& after a test the reader cannot decide doubles the runs to follow.
        reader = check_contract.ScriptReader('case $(uname) in\n' + ''.join(
            'p%d) a=%d ;;&\n' % (i, i) for i in range(10)) + 'esac\nnvcc -arch=sm_80 -o "$1/l.so"\n')
        self.assertEqual((reader.unfollowed, reader.calls), ([(1, "a case with more than 256 ways to run")], []))

    def test_a_program_the_reader_does_not_read_is_cannot_tell_not_b005(self):
        for line in ("exec scripts/compile.sh \"$1\"", "python3 build.py \"$1\"",
                     "trap 'nvcc -shared -arch=sm_80 -o \"$1/libfat.so\" ops.cu' ERR",
                     "sudo -E nvcc -shared -arch=sm_80 -o \"$1/libfat.so\" ops.cu",
                     "numactl --cpunodebind=0 nvcc -shared -arch=sm_80 -o \"$1/libfat.so\" ops.cu",
                     "bash \"$(dirname \"$0\")/compile.sh\" \"$1\""):
            with self.subTest(line=line):
                self.cuda_fat(line + "\n")
                self.assertEqual(self.codes(), ["B017"])
        self.assertIssue("B017", "cannot tell which library build.sh writes: it has no compiler "
                         "command with -o that the checker can see; the checker does not follow "
                         "line 2 (bash $(dirname \"$0\")/compile.sh, a program whose commands it "
                         "does not read)", "warning")

    def test_a_target_nvcc_rejects_is_an_error_read_and_traced(self):
        self.cuda_fat('mkdir -p "$1"\nnvcc -shared -gencode arch=compute_80,code=sm_80 -gencode arch=compute_90,code=sm90 '
                      'ops.cu -o "$1/libfat.so"\n', architectures=(80, 90))
        message = ("build.sh builds with -gencode arch=compute_90,code=sm90: nvcc knows no target "
                   "sm90; write sm_90")
        self.assertIssue("B018", message)
        rc, out, err = self.check("trace", "--format", "json")
        (result,) = json.loads(out)["results"]
        self.assertEqual(rc, 1)
        self.assertIn(("error", "B018", "running build.sh <output-dir> shows: " + message),
                      [(i["level"], i["code"], i["message"]) for i in result["issues"]])

    def test_the_library_is_what_is_in_the_output_directory_at_the_end(self):
        for placing in ('mkdir -p build\nnvcc -shared -arch=sm_80 -o build/libfat.so ops.cu\n'
                        'cp build/libfat.so "$1/"\n',
                        'nvcc -shared -arch=sm_80 -o tmp.so ops.cu\nmv tmp.so "$1/libfat.so"\n',
                        'nvcc -shared -arch=sm_80 -o "$1/libfat.so.1" ops.cu\n'
                        'ln -sf libfat.so.1 "$1/libfat.so"\n',
                        'mkdir -p build\nnvcc -shared -arch=sm_80 -o build/libfat.so ops.cu\n'
                        'install -m 755 -t "$1" build/libfat.so\n'):
            with self.subTest(placing=placing):
                self.cuda_fat('mkdir -p "$1"\ncd "$(dirname "$0")"\n' + placing)
                self.assertClean()
                rc, out, err = self.check("trace", "--format", "json")
                self.assertEqual(json.loads(out)["results"][0]["issues"], [])
        self.cuda_fat('mkdir -p "$1"\nnvcc -shared -arch=sm_80 -o "$1/libfat.so" ops.cu\n'
                      'mv "$1/libfat.so" /tmp/\n')
        message = ("build script build.sh writes libfat.so with -o, but it is not in <output-dir> "
                   "when the script ends (moved or removed after); leave build.output there")
        self.assertIssue("B013", message)
        self.cuda_fat('mkdir -p "$1"\ncd "$(dirname "$0")"\nnvcc -shared -arch=sm_80 -o "$1/libfat.so" ops.cu\n'
                      'mv "$(dirname "$1")/$(basename "$1")/libfat.so" "$TMPDIR/x-$$.so"\n')
        self.assertClean()  # the reader cannot see that this names the library
        rc, out, err = self.check("trace", "--format", "json")
        self.assertEqual([(i["code"], i["message"]) for i in json.loads(out)["results"][0]["issues"]],
                         [("B013", "running build.sh <output-dir> %sshows: " % run + message)
                          for run in ("80 ", "")])
        self.cuda_fat('mkdir -p "$1"\nnvcc -shared -arch=sm_80 -o build/libfat.so ops.cu\n'
                      'cp build/libfat.so "$1/lib"\n')
        self.assertIssue("B017", "cannot tell whether libfat.so is in <output-dir> when build.sh "
                         "ends: line 4 puts a file there whose name the checker cannot tell", "warning")

    def cuda_fat(self, script, architectures=(80,)):
        files = fat_files(architectures=list(architectures), default_arch=architectures[0])
        files["backends/cuda/fat/build.sh"] = Executable("#!/usr/bin/env bash\n" + script)
        self.tree(files)


QWEN_BUILD = Executable("""#!/usr/bin/env bash
# Build the Qwen3.5 CUDA backend: ./build.sh <output-dir> [<compute-capability>]
set -euo pipefail
out=${1:?usage: build.sh <output-dir> [<compute-capability>]}
arch=${2:-89}
nvcc=${NVCC:-}
if [ -z "$nvcc" ]; then
    if [ -n "${CUDA_HOME:-}" ]; then nvcc=$CUDA_HOME/bin/nvcc; else nvcc=$(command -v nvcc); fi
fi
here=$(cd "$(dirname "$0")" && pwd)
mkdir -p "$out"
"$nvcc" -O3 -gencode "arch=compute_${arch},code=[sm_${arch},compute_${arch}]" \\
    -std=c++17 -shared -Xcompiler -fPIC,-fvisibility=hidden --expt-relaxed-constexpr \\
    "$here"/*.cu -o "$out/libqwen3_5_cuda.so"
""")


class AcceptanceTest(TreeTest):
    def test_the_qwen3_5_cuda_backend_is_clean_buildable_and_what_init_writes(self):
        kernels = ["attention.cu", "embedding.cu", "errors.cu", "gemv.cu", "moe.cu", "rmsnorm.cu",
                   "rope.cu"]
        manifest = {"name": "qwen3_5", "platform": "cuda",
                    "status": "experimental", "abi_version": 6,
                    "sources": sorted(["common.cuh", "qwen3_5.h"] + kernels),
                    "build": {"script": "build.sh", "output": "libqwen3_5_cuda.so",
                              "architectures": [89], "default_arch": 89}}
        files = {"backends/cuda/qwen3_5/qwen3_5.backend.json": manifest,
                 "backends/cuda/qwen3_5/build.sh": QWEN_BUILD,
                 "backends/cuda/qwen3_5/common.cuh": '#pragma once\n#include "qwen3_5.h"\n',
                 "backends/cuda/qwen3_5/qwen3_5.h":
                     "#pragma once\n#include <stdint.h>\n#define QWEN3_5_ABI_VERSION 6\n"
                     "uint32_t qwen3_5_abi_version(void);\nconst char* qwen3_5_error_string(int code);\n"}
        files.update(("backends/cuda/qwen3_5/" + k, '#include "common.cuh"\n') for k in kernels)
        self.tree(files)
        self.assertEqual(len(manifest["sources"]), 9)
        rc, out, err = self.check()
        self.assertEqual((rc, err), (0, ""))
        self.assertTrue(out.endswith("\n1 backend(s), 0 error(s), 0 warning(s)\n"), out)
        rc, out, err = self.check("list", "--buildable")
        self.assertEqual((rc, out, err), (0, "cuda/qwen3_5 platform=cuda status=experimental\n", ""))
        for reading in ("--no-trace", "--force"):  # read, then traced when bash is here
            with self.subTest(reading=reading):
                os.unlink(self.path("backends/cuda/qwen3_5/qwen3_5.backend.json"))
                rc, out, err = self.check("init", reading, self.path("backends/cuda/qwen3_5"))
                self.assertEqual((rc, err), (0, ""), out)
                with open(self.path("backends/cuda/qwen3_5/qwen3_5.backend.json")) as handle:
                    self.assertEqual(json.load(handle), manifest)


def show(word):
    return check_contract.show_word(word)


class StatusTest(TreeTest):
    def test_validated_requires_tolerances(self):
        manifest = demo_manifest()
        manifest["numerics"]["tolerance"] = {"note": "none yet"}
        self.tree(demo_files(manifest))
        self.assertIssue("T001", "status is validated but numerics.tolerance gives no op tolerance; "
                         "add one per op")

    def test_validated_requires_an_entrypoint(self):
        manifest = demo_manifest()
        del manifest["reference"]
        self.tree(demo_files(manifest))
        self.assertIssue("T002", "status is validated but reference.entrypoint is not given")

    def test_missing_entrypoint_is_an_error_when_validated(self):
        files = demo_files()
        del files["backends/cpu/demo/parity.py"]
        self.tree(files)
        self.assertIssue("T002", 'reference.entrypoint "backends/cpu/demo/parity.py" does not exist '
                         "(it is relative to the repository root)")

    def test_missing_entrypoint_is_a_warning_when_experimental(self):
        files = demo_files(demo_manifest(status="experimental"))
        del files["backends/cpu/demo/parity.py"]
        self.tree(files)
        self.assertIssue("T002", 'reference.entrypoint "backends/cpu/demo/parity.py" does not exist '
                         "(it is relative to the repository root)", "warning")

    def test_entrypoint_outside_the_repository_is_named(self):
        for entry in ("/etc/hostname", "../outside.py", "backends/../../x.py"):
            with self.subTest(entry=entry):
                self.tree(demo_files(demo_manifest(reference={"entrypoint": entry})))
                self.assertIssue("T002", "reference.entrypoint %s must be relative to the repository "
                                 "root, and inside it" % json.dumps(entry))

    def test_entrypoint_linked_outside_the_repository_is_s002_and_parity_does_not_run_it(self):
        outside = tempfile.mkdtemp(prefix="check-contract-outside-")
        self.addCleanup(shutil.rmtree, outside, True)
        with open(os.path.join(outside, "parity.py"), "w") as handle:
            handle.write("print('ran outside')\n")
        files = demo_files()
        del files["backends/cpu/demo/parity.py"]
        self.tree(files)
        os.symlink(os.path.join(outside, "parity.py"), self.path("backends/cpu/demo/parity.py"))
        real = os.path.realpath(os.path.join(outside, "parity.py"))
        self.assertIssue("S002", 'reference.entrypoint "backends/cpu/demo/parity.py" is a symbolic link '
                         "to %s, outside the repository, which parity would run; keep the reference "
                         "in the repository" % real)
        rc, out, err = self.check("parity", "--format", "json")
        result, = json.loads(out)["results"]
        self.assertEqual((rc, result["result"], [i["message"] for i in result["issues"]]), (1, "failed", [
            'reference.entrypoint "backends/cpu/demo/parity.py" is a symbolic link to %s, outside the '
            "repository; parity runs no file from outside it" % real]))

    def test_missing_model_dir_is_a_warning(self):
        self.tree(demo_files(demo_manifest(models=["models/qwen/", "models/llama/"]),
                             **{"models/qwen/config.json": "{}"}))
        rc, issues = self.issues()
        self.assertEqual(rc, 0)
        self.assertEqual([(i["level"], i["code"], i["message"]) for i in issues],
                         [("warning", "O001", 'models lists "models/llama/", which does not exist')])

    def test_each_bad_model_entry_is_named(self):
        self.tree(demo_files(demo_manifest(models=["models/qwen/", "models/llama", "/etc/", "../",
                                                   "models/../../x/"]),
                             **{"models/qwen/config.json": "{}"}))
        rc, issues = self.issues()
        self.assertEqual(rc, 1)
        expected = "a directory relative to the repository root, inside it, ending in /"
        self.assertEqual([i["message"] for i in issues],
                         ['"models[%d]" must be %s, not %s' % (index, expected, json.dumps(value))
                          for index, value in ((1, "models/llama"), (2, "/etc/"), (3, "../"),
                                               (4, "models/../../x/"))])


class CommandLineTest(TreeTest):
    def test_unknown_name_is_a_usage_error(self):
        self.tree(demo_files())
        self.assertEqual(self.check("nope"), (2, "", 'check_contract.py: error: no backend named "nope" '
                                              "under backends/ (known: cpu/demo)\n"))

    def test_a_platform_alone_is_no_backend(self):
        files = demo_files()
        files.update({"backends/metal/k/k.backend.json": demo_manifest(name="k", platform="metal"),
                      "backends/metal/k/ops.c": ""})
        self.tree(files)
        for platform in ("metal", "cpu"):
            with self.subTest(platform=platform):
                self.assertEqual(self.check("check", platform), (
                    2, "", 'check_contract.py: error: no backend named "%s" under backends/ (known: '
                    'cpu/demo, metal/k); "%s" is a platform directory: name its backends as %s/<name>\n'
                    % (platform, platform, platform)))
        self.assertEqual(self.check("check", "tpu"), (
            2, "", 'check_contract.py: error: no backend named "tpu" under backends/ (known: '
            'cpu/demo, metal/k)\n'))

    def test_a_backend_directory_with_a_trailing_slash_names_it(self):
        self.tree(demo_files())
        for name in ("cpu/demo/", "demo/", "backends/cpu/demo/", "backends/cpu/demo"):
            with self.subTest(name=name):
                rc, out, err = self.check(name)
                self.assertEqual((rc, err), (0, ""))
                self.assertIn("checked cpu/demo: status=validated", out)

    def test_a_mistyped_command_is_suggested(self):
        self.tree(demo_files())
        for argv, hint in ((["chek"], 'did you mean the command "check"?'),
                           (["lsit"], 'did you mean the command "list"?'),
                           (["--strict", "list"], '"list" is a command: give it before the options '
                                                  "(check_contract.py list ...)"),
                           (["dmeo"], 'did you mean "demo"?')):
            with self.subTest(argv=argv):
                self.assertEqual(self.check(*argv), (
                    2, "", 'check_contract.py: error: no backend named "%s" under backends/ (known: '
                    "cpu/demo); %s\n" % (argv[-1], hint)))

    def test_names_limit_the_run(self):
        files = demo_files()
        files.update(fat_files())
        files["backends/cpu/demo/extra.c"] = ""
        self.tree(files)
        rc, out, err = self.check("fat")
        self.assertEqual((rc, out), (0, "checked cuda/fat: status=experimental abi=2\n"
                                        "1 backend(s), 0 error(s), 0 warning(s)\n"))
        rc, out, err = self.check("check", "cpu/demo")
        self.assertEqual((rc, err), (1, ""))
        self.assertTrue(out.startswith("backends/cpu/demo/extra.c: [error] S004 cpu/demo: kernel "
                                       "source extra.c is not declared in sources"), out)

    def test_missing_repo_root_is_a_usage_error(self):
        missing = self.path("nowhere")
        self.assertEqual(run_main(["--root", missing]),
                         (2, "", "check_contract.py: error: --root %s: no such directory; give "
                                 "the repository root\n" % missing))

    def test_bad_flag_is_a_usage_error(self):
        rc, out, err = self.check("--frobnicate")
        self.assertEqual((rc, out), (2, ""))
        self.assertIn("unrecognized arguments: --frobnicate", err)

    def test_strict_fails_on_warnings(self):
        manifest = demo_manifest()
        manifest["colour"] = 1
        self.tree(demo_files(manifest))
        self.assertEqual(self.check()[0], 0)
        self.assertEqual(self.check("--strict")[0], 1)

    def test_json_alias_and_fields(self):
        self.tree(demo_files(**{"backends/cpu/demo/x.c": ""}))
        rc, out, err = self.check("--json")
        self.assertEqual(rc, 1)
        self.assertEqual(json.loads(out), {
            "checked": ["cpu/demo"], "errors": 1, "warnings": 0, "suppressed": [],
            "issues": [{"level": "error", "code": "S004", "backend": "cpu/demo",
                        "path": "backends/cpu/demo/x.c", "line": None,
                        "message": "kernel source x.c is not declared in sources; add it, or list it "
                                   "in excluded if it is not part of the library"}]})

    def test_json_with_another_format_is_a_usage_error(self):
        self.tree(demo_files())
        self.assertEqual(self.check("--json", "--format", "github"),
                         (2, "", "check_contract.py: error: --json and --format github ask for two "
                                 "formats; give one\n"))
        self.assertEqual(self.check("--json", "--format", "json")[0], 0)

    def test_github_format_is_the_default_on_github_actions(self):
        self.tree(demo_files(demo_manifest(abi_version=3)))
        expected = ("::error file=backends/cpu/demo/ops.h,line=4,title=A001::cpu/demo: abi_version is 3 "
                    "but ops.h defines DEMO_ABI_VERSION 1 (line 4); make them equal\n"
                    "1 backend(s), 1 error(s), 0 warning(s)\n")
        self.assertEqual(self.check("--format", "github"), (1, expected, ""))
        self.assertEqual(self.check(env={"GITHUB_ACTIONS": "true"}), (1, expected, ""))

    def test_list_formats(self):
        files = demo_files()
        files.update(fat_files())
        self.tree(files)
        self.assertEqual(run_main(["--repo-root", self.root, "list"]),
                         (0, "cpu/demo platform=cpu status=validated\n"
                             "cuda/fat platform=cuda status=experimental\n", ""))
        rc, out, err = run_main(["--repo-root", self.root, "list", "--format", "github-matrix"])
        self.assertEqual(json.loads(out), {"include": [
            {"name": "demo", "platform": "cpu", "dir": "backends/cpu/demo",
             "script": "backends/cpu/demo/build.sh", "output": "libdemo.so", "default_arch": "x86-64"},
            {"name": "fat", "platform": "cuda", "dir": "backends/cuda/fat",
             "script": "backends/cuda/fat/build.sh", "output": "libfat.so", "default_arch": "90"}]})
        rc, out, err = run_main(["--repo-root", self.root, "list", "--format", "json"])
        self.assertEqual([row["architectures"] for row in json.loads(out)], [["x86-64"], ["80", "89", "90"]])

    def test_list_buildable_drops_planned_broken_and_non_executable(self):
        files = demo_files()
        files.update(fat_files())
        files["backends/cuda/fat/extra.cu"] = ""
        files["backends/cpu/plan/plan.backend.json"] = dict(demo_manifest(name="plan", status="planned"))
        self.tree(files)
        rc, out, err = run_main(["--repo-root", self.root, "list", "--buildable"])
        self.assertEqual((rc, out), (0, "cpu/demo platform=cpu status=validated\n"))
        os.chmod(self.path("backends/cpu/demo/build.sh"), 0o644)
        self.assertEqual(run_main(["--repo-root", self.root, "list", "--buildable"])[1], "")

    def test_init_writes_and_checks_a_manifest(self):
        files = fat_files()
        del files["backends/cuda/fat/fat.backend.json"]
        files["backends/cuda/fat/tests/test_fat.py"] = ""
        files["backends/backend.schema.json"] = "{}"
        self.tree(files)
        rc, out, err = run_main(["--repo-root", self.root, "init", self.path("backends/cuda/fat")])
        self.assertEqual((rc, err), (0, ""))
        self.assertTrue(out.endswith("checked cuda/fat: status=experimental abi=2\n"
                                     "1 backend(s), 0 error(s), 0 warning(s)\n"), out)
        with open(self.path("backends/cuda/fat/fat.backend.json")) as handle:
            self.assertEqual(json.load(handle), {
                "$schema": "../../backend.schema.json", "name": "fat", "platform": "cuda",
                "status": "experimental", "abi_version": 2, "sources": ["fat.cuh", "ops.cu"],
                "build": {"script": "build.sh", "output": "libfat.so", "architectures": [80, 89, 90]}})

    def test_init_names_a_schema_only_when_the_repository_has_one(self):
        files = fat_files()
        del files["backends/cuda/fat/fat.backend.json"]
        self.tree(files)
        rc, out, err = run_main(["--repo-root", self.root, "init", self.path("backends/cuda/fat")])
        self.assertEqual((rc, err), (0, ""))
        with open(self.path("backends/cuda/fat/fat.backend.json")) as handle:
            self.assertNotIn("$schema", json.load(handle))

    def test_init_takes_default_arch_from_the_script(self):
        files = demo_files()
        del files["backends/cpu/demo/demo.backend.json"]
        self.tree(files)
        rc, out, err = run_main(["--repo-root", self.root, "init", self.path("backends/cpu/demo")])
        self.assertEqual(rc, 0, out + err)
        with open(self.path("backends/cpu/demo/demo.backend.json")) as handle:
            self.assertEqual(json.load(handle)["build"], {
                "script": "build.sh", "output": "libdemo.so", "architectures": ["x86-64"],
                "default_arch": "x86-64"})

    def test_init_says_what_it_cannot_tell_and_writes_nothing(self):
        for script, message in (
                ('nvcc -shared ops.cu -o "$1/libfat.so"\n',
                 "init: cannot tell which architectures build.sh builds (no target flag); give each "
                 "target in a flag of its own (-gencode, -arch or -code) and run init again, or "
                 "write the manifest yourself"),
                ('nvcc -shared -arch=native ops.cu -o "$1/libfat.so"\n',
                 "init: cannot tell which architectures build.sh builds (-arch=native); give each "
                 "target in a flag of its own (-gencode, -arch or -code) and run init again, or "
                 "write the manifest yourself")):
            with self.subTest(script=script):
                files = fat_files()
                del files["backends/cuda/fat/fat.backend.json"]
                files["backends/cuda/fat/build.sh"] = Executable("#!/bin/sh\n" + script)
                self.tree(files)
                rc, out, err = run_main(["--repo-root", self.root, "init", "--no-trace",
                                         self.path("backends/cuda/fat")])
                self.assertEqual((rc, out, err), (1, "", "check_contract.py: error: %s\n" % message))
                self.assertFalse(os.path.exists(self.path("backends/cuda/fat/fat.backend.json")))

    def test_init_refuses_to_overwrite_without_force(self):
        self.tree(demo_files())
        target = self.path("backends/cpu/demo")
        rc, out, err = run_main(["--repo-root", self.root, "init", target])
        self.assertEqual((rc, out), (2, ""))
        self.assertIn("demo.backend.json already exists; use --force to overwrite it\n", err)
        rc, out, err = run_main(["--repo-root", self.root, "init", "--force", target])
        self.assertEqual(rc, 0, out + err)

    def test_init_of_a_missing_directory_says_which_to_give(self):
        self.tree(demo_files())
        self.assertEqual(run_main(["--repo-root", self.root, "init", "backends/cpu/nope"]),
                         (2, "", "check_contract.py: error: init backends/cpu/nope: no such "
                                 "directory; give the directory of the backend's sources, "
                                 "backends/<platform>/<name>\n"))

    def test_init_refuses_a_directory_outside_the_backends(self):
        self.tree(demo_files(**{"elsewhere/x.c": ""}))
        rc, out, err = run_main(["--repo-root", self.root, "init", self.path("elsewhere")])
        self.assertEqual(rc, 2)
        self.assertIn("not a backend directory; give backends/<platform>/<name>", err)

    def test_init_that_cannot_write_changes_nothing(self):
        files = demo_files()
        del files["backends/cpu/demo/demo.backend.json"]
        self.tree(files)
        os.mkdir(self.path("backends/cpu/demo/demo.backend.json.tmp"))
        before = sorted(os.listdir(self.path("backends/cpu/demo")))
        rc, out, err = run_main(["--repo-root", self.root, "init", self.path("backends/cpu/demo")])
        self.assertEqual((rc, out), (1, ""))
        self.assertIn("init: cannot write ", err)
        self.assertTrue(err.endswith("demo/demo.backend.json.tmp is in the way; remove it; "
                                     "nothing was written\n"), err)
        self.assertEqual(sorted(os.listdir(self.path("backends/cpu/demo"))), before)

    def test_option_without_its_value_is_a_usage_error(self):
        for argv in (["--repo-root"], ["--backends-dir", "x", "--repo-root"], ["check", "--repo-root"]):
            with self.subTest(argv=argv):
                rc, out, err = run_main(argv)
                self.assertEqual((rc, out), (2, ""))
                self.assertIn("argument --repo-root: expected one argument", err)

    def test_names_the_terminal_cannot_show_are_escaped(self):
        self.tree(demo_files(**{"backends/cpu/demo/k\u00e9.cu": ""}))
        done = subprocess.run([sys.executable, CHECKER, "--repo-root", self.root],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              env=dict(os.environ, PYTHONIOENCODING="ascii"))
        self.assertEqual((done.returncode, done.stderr), (1, b""))
        self.assertIn(b"kernel source k\\xe9.cu is not declared", done.stdout)

    def test_repository_itself_passes(self):
        self.assertEqual(run_main(["--repo-root", HERE])[0], 0)


class TextOutputTest(TreeTest):
    """`path:line: [level] CODE backend: message`, the place the way
    compilers print it."""

    def in_directory(self, rel, *args):
        saved = os.getcwd()
        os.chdir(self.path(rel))
        try:
            return run_main(list(args))
        finally:
            os.chdir(saved)

    def test_finding_starts_with_path_and_line(self):
        self.tree(demo_files(**{"backends/cpu/demo/ops.h": OPS_H.replace("VERSION 1", "VERSION 2")}))
        rc, out, err = self.check()
        self.assertEqual((rc, err), (1, ""))
        self.assertEqual(out.splitlines()[0],
                         "backends/cpu/demo/ops.h:4: [error] A001 cpu/demo: abi_version is 1 but "
                         "ops.h defines DEMO_ABI_VERSION 2 (line 4); make them equal")
        self.assertEqual(out.splitlines()[-1], "1 backend(s), 1 error(s), 0 warning(s)")

    def test_path_is_relative_to_the_current_directory_inside_it(self):
        self.tree(demo_files(**{"backends/cpu/demo/extra.c": ""}))
        rc, out, err = self.in_directory("backends/cpu", "--repo-root", self.root)
        self.assertEqual((rc, err), (1, ""))
        self.assertIn("demo/extra.c: [error] S004 cpu/demo: kernel source extra.c is not declared", out)
        rc, out, err = self.in_directory("backends", "--repo-root", self.root)
        self.assertIn("\ncpu/demo/extra.c: [error] S004 ", "\n" + out)

    def test_path_outside_the_current_directory_is_relative_to_the_root(self):
        self.tree(demo_files(**{"backends/cpu/demo/extra.c": "", "elsewhere/x": ""}))
        rc, out, err = self.in_directory("elsewhere", "--repo-root", self.root)
        self.assertEqual(rc, 1)
        self.assertIn("\nbackends/cpu/demo/extra.c: [error] S004 cpu/demo: ", "\n" + out)

    def test_finding_without_a_line_has_the_path_alone(self):
        manifest = demo_manifest()
        del manifest["status"]
        self.tree(demo_files(manifest))
        rc, out, err = self.check()
        self.assertEqual((rc, err), (1, ""))
        self.assertIn("\nbackends/cpu/demo/demo.backend.json: [error] M001 cpu/demo: missing required "
                      'key "status"\n', "\n" + out)

    def test_a_newline_in_a_file_name_cannot_forge_a_report_line(self):
        forged = "x.c\n0 backend(s), 0 error(s), 0 warning(s)\n\x1b[2K.c"
        self.tree(demo_files(**{"backends/cpu/demo/" + forged: ""}))
        rc, out, err = self.check()
        self.assertEqual((rc, err), (1, ""))
        lines = out.splitlines()
        self.assertEqual(len(lines), 3, out)
        self.assertEqual(lines[0], "backends/cpu/demo/x.c\\n0 backend(s), 0 error(s), 0 warning(s)"
                                   "\\n\\x1b[2K.c: [error] S004 cpu/demo: kernel source x.c\\n0 "
                                   "backend(s), 0 error(s), 0 warning(s)\\n\\x1b[2K.c is not declared "
                                   "in sources; add it, or list it in excluded if it is not part of "
                                   "the library")
        self.assertEqual(lines[2], "1 backend(s), 1 error(s), 0 warning(s)")

    def test_a_newline_in_a_backend_name_cannot_forge_a_list_line(self):
        files = {p.replace("/demo/demo.", "/a\nb/a\nb.").replace("/demo/", "/a\nb/"): c
                 for p, c in demo_files(demo_manifest(name="a\nb")).items()}
        self.tree(files)
        rc, out, err = self.check("list")
        self.assertEqual((rc, out, err), (0, "cpu/a\\nb platform=cpu status=validated\n", ""))



MAKE_BUILD = Executable("#!/bin/sh\nmake -C src\n")  # the reader cannot tell what make builds: B017


def manifest_line(text, needle):
    """The number of the first line of `text` holding `needle`."""
    return next(n for n, line in enumerate(text.splitlines(True), 1) if needle in line)


class FormatsTest(TreeTest):
    """Every command that reports findings prints them as text, JSON or
    GitHub annotations, the annotations by default under GitHub Actions."""

    def test_every_command_with_findings_offers_github(self):
        for name, parser in subcommands(check_contract.build_parser()).items():
            with self.subTest(command=name):
                (fmt,) = [a for a in parser._actions if "--format" in a.option_strings]
                self.assertLessEqual({"text", "json"}, set(fmt.choices))
                if name != "list":  # a listing holds no findings: its GitHub form is github-matrix
                    self.assertIn("github", fmt.choices)

    def test_trace_prints_annotations_under_github_actions(self):
        self.tree(demo_files(**{"backends/cpu/demo/build.sh": Executable(
            '#!/bin/sh\nmkdir -p "$1"\ncc -shared -march=${2:-x86-64} ops.c -o "$1/libother.so"\n')}))
        annotation = ("::error file=backends/cpu/demo/build.sh,title=B004::cpu/demo: running build.sh "
                      "<output-dir> shows: build script build.sh writes \"libother.so\" but "
                      "build.output is \"libdemo.so\"\n")
        for argv in (["--root", ".", "--format", "github", "trace"], ["--root", ".", "trace"]):
            with self.subTest(argv=argv):
                done = subprocess.run([sys.executable, CHECKER] + argv, cwd=self.root,
                                      env=dict(os.environ, GITHUB_ACTIONS="true"),
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                      universal_newlines=True, timeout=120)
                self.assertEqual(done.returncode, 1, done.stdout + done.stderr)
                self.assertIn("\n" + annotation, done.stdout)
                self.assertNotIn("[error]", done.stdout)
                self.assertTrue(done.stdout.endswith("\n0 backend(s) passed, 1 failed, 0 skipped\n"),
                                done.stdout)

    def test_a_tier_prints_its_findings_as_annotations(self):
        files = tiny_files(status="validated")
        files["backends/cpu/tiny/parity.py"] = "raise SystemExit(3)\n"
        self.tree(files)
        expected = ("::error file=backends/cpu/tiny/parity.py,title=P001::cpu/tiny: "
                    "backends/cpu/tiny/parity.py failed (exit status 3)\n"
                    "0 backend(s) passed, 1 failed, 0 skipped\n")
        for argv, env in ((["parity", "--format", "github"], None),
                          (["parity"], {"GITHUB_ACTIONS": "true"})):
            with self.subTest(argv=argv):
                rc, out, err = self.check(*argv, env=env)
                self.assertEqual((rc, err), (1, ""))
                self.assertRegex(out, r"\nfailed cpu/tiny: backends/cpu/tiny/parity.py failed "
                                      r"\(exit status 3\) \([0-9.]+s\)\n")
                self.assertTrue(out.endswith("s)\n" + expected), out)
        rc, out, err = self.check("parity")
        self.assertIn("\nbackends/cpu/tiny/parity.py: [error] P001 cpu/tiny: ", out)

    def test_init_reports_in_the_format_asked_for(self):
        files = demo_files()
        del files["backends/cpu/demo/demo.backend.json"]
        self.tree(files)
        rc, out, err = self.check("init", "--no-trace", "--format", "json",
                                  self.path("backends/cpu/demo"))
        self.assertEqual(rc, 0, out + err)
        self.assertEqual(json.loads(out)["checked"], ["cpu/demo"])
        self.assertRegex(err, r"^wrote .*demo\.backend\.json\n\Z")

    def test_sarif_for_code_scanning(self):
        manifest = demo_manifest()
        manifest["colour"] = 1
        manifest["ignore"] = {"B017": "built by make; proved by trace"}
        self.tree(demo_files(manifest, **{"backends/cpu/demo/build.sh": MAKE_BUILD}))
        rc, out, err = self.check("--format", "sarif")
        self.assertEqual((rc, err), (0, ""))
        sarif = json.loads(out)
        self.assertEqual(sarif["version"], "2.1.0")
        (run,) = sarif["runs"]
        self.assertEqual(run["tool"]["driver"]["name"], "check_contract.py")
        self.assertEqual(run["tool"]["driver"]["rules"], [{"id": "B017"}, {"id": "M003"}])
        text = json.dumps(manifest, indent=2)
        self.assertEqual(run["results"], [
            {"ruleId": "M003", "level": "warning",
             "message": {"text": 'cpu/demo: unknown key "colour"'},
             "locations": [{"physicalLocation": {
                 "artifactLocation": {"uri": "backends/cpu/demo/demo.backend.json",
                                      "uriBaseId": "%SRCROOT%"},
                 "region": {"startLine": manifest_line(text, '"colour"')}}}]},
            {"ruleId": "B017", "level": "warning",
             "message": {"text": "cpu/demo: cannot tell which library build.sh writes: it has no "
                                 "compiler command with -o that the checker can see; the checker "
                                 "does not follow line 2 (make, whose build rules it does not read)"},
             "locations": [{"physicalLocation": {
                 "artifactLocation": {"uri": "backends/cpu/demo/build.sh", "uriBaseId": "%SRCROOT%"},
                 "region": {"startLine": 2}}}],
             "suppressions": [{"kind": "external", "justification": "built by make; proved by trace"}]}])

class ReportOrderTest(TreeTest):
    """Every format lists the findings in one order, by backend, path, line,
    code and message, whatever order the checks found them in, and each with
    its own level."""

    def setUp(self):
        super().setUp()
        manifest = {"zebra": 1}
        manifest.update(demo_manifest(colour=1))
        files = demo_files(manifest, **{"backends/cpu/demo/b.c": "",
                                        "backends/cpu/demo/ops.h": OPS_H.replace("VERSION 1", "VERSION 2")})
        files.update(("backends/cpu/alpha/" + p.split("/")[-1].replace("demo.", "alpha."), c)
                     for p, c in demo_files(demo_manifest(name="alpha"), **{"backends/cpu/demo/x.c": ""}).items())
        self.tree(files)
        text = json.dumps(manifest, indent=2)
        self.lines = {key: manifest_line(text, '"%s"' % key) for key in ("zebra", "colour")}
        self.undeclared = ("kernel source %s is not declared in sources; add it, or list it in excluded "
                           "if it is not part of the library")
        self.abi = "abi_version is 1 but ops.h defines DEMO_ABI_VERSION 2 (line 4); make them equal"

    def test_text(self):
        rc, out, err = self.check()
        self.assertEqual((rc, err), (1, ""))
        self.assertEqual(out, (
            "backends/cpu/alpha/x.c: [error] S004 cpu/alpha: %s\n"
            "backends/cpu/demo/b.c: [error] S004 cpu/demo: %s\n"
            "backends/cpu/demo/demo.backend.json:%d: [warning] M003 cpu/demo: unknown key \"zebra\"\n"
            "backends/cpu/demo/demo.backend.json:%d: [warning] M003 cpu/demo: unknown key \"colour\"\n"
            "backends/cpu/demo/ops.h:4: [error] A001 cpu/demo: %s\n"
            "checked cpu/alpha: status=validated abi=1\n"
            "checked cpu/demo: status=validated abi=1\n"
            "2 backend(s), 3 error(s), 2 warning(s)\n"
            % (self.undeclared % "x.c", self.undeclared % "b.c", self.lines["zebra"],
               self.lines["colour"], self.abi)))

    def test_json(self):
        rc, out, err = self.check("--format", "json")
        self.assertEqual((rc, err), (1, ""))
        report = json.loads(out)
        self.assertEqual((report["errors"], report["warnings"], report["suppressed"]), (3, 2, []))
        issues = report["issues"]
        self.assertEqual([(i["level"], i["code"], i["backend"], i["path"], i["line"]) for i in issues], [
            ("error", "S004", "cpu/alpha", "backends/cpu/alpha/x.c", None),
            ("error", "S004", "cpu/demo", "backends/cpu/demo/b.c", None),
            ("warning", "M003", "cpu/demo", "backends/cpu/demo/demo.backend.json", self.lines["zebra"]),
            ("warning", "M003", "cpu/demo", "backends/cpu/demo/demo.backend.json", self.lines["colour"]),
            ("error", "A001", "cpu/demo", "backends/cpu/demo/ops.h", 4)])

    def test_github(self):
        rc, out, err = self.check("--format", "github")
        self.assertEqual((rc, err), (1, ""))
        self.assertEqual(out, (
            "::error file=backends/cpu/alpha/x.c,title=S004::cpu/alpha: %s\n"
            "::error file=backends/cpu/demo/b.c,title=S004::cpu/demo: %s\n"
            "::warning file=backends/cpu/demo/demo.backend.json,line=%d,title=M003::cpu/demo: "
            "unknown key \"zebra\"\n"
            "::warning file=backends/cpu/demo/demo.backend.json,line=%d,title=M003::cpu/demo: "
            "unknown key \"colour\"\n"
            "::error file=backends/cpu/demo/ops.h,line=4,title=A001::cpu/demo: %s\n"
            "2 backend(s), 3 error(s), 2 warning(s)\n"
            % (self.undeclared % "x.c", self.undeclared % "b.c", self.lines["zebra"],
               self.lines["colour"], self.abi)))

    def test_sarif(self):
        rc, out, err = self.check("--format", "sarif")
        self.assertEqual((rc, err), (1, ""))
        (run,) = json.loads(out)["runs"]
        self.assertEqual([(r["level"], r["ruleId"], r["locations"][0]["physicalLocation"][
            "artifactLocation"]["uri"], r["locations"][0]["physicalLocation"].get("region"))
            for r in run["results"]], [
            ("error", "S004", "backends/cpu/alpha/x.c", None),
            ("error", "S004", "backends/cpu/demo/b.c", None),
            ("warning", "M003", "backends/cpu/demo/demo.backend.json", {"startLine": self.lines["zebra"]}),
            ("warning", "M003", "backends/cpu/demo/demo.backend.json", {"startLine": self.lines["colour"]}),
            ("error", "A001", "backends/cpu/demo/ops.h", {"startLine": 4})])


class AnnotationEscapingTest(TreeTest):
    """GitHub reads `%`, CR and LF as escapes in an annotation's message, and
    `:` and `,` too in its properties (file=): each is written escaped, `%`
    first so that the escapes themselves are not escaped again."""

    def test_a_file_name_with_every_character_github_reads(self):
        self.tree(demo_files(**{"backends/cpu/demo/a%0A,b:c\r\n.c": ""}))
        rc, out, err = self.check("--format", "github")
        self.assertEqual((rc, err), (1, ""))
        self.assertEqual(out.splitlines(True)[0],
                         "::error file=backends/cpu/demo/a%250A%2Cb%3Ac%0D%0A.c,title=S004::cpu/demo: "
                         "kernel source a%250A,b:c%0D%0A.c is not declared in sources; add it, or list "
                         "it in excluded if it is not part of the library\n")


class SuppressionTest(TreeTest):
    """A warning accepted on purpose, with a reason: counted, never dropped."""

    def backend(self, ignore=None, script=MAKE_BUILD):
        manifest = demo_manifest()
        if ignore is not None:
            manifest["ignore"] = ignore
        self.tree(demo_files(manifest, **{"backends/cpu/demo/build.sh": script}))
        return json.dumps(manifest, indent=2)

    def test_a_manifest_entry_suppresses_the_warning_and_the_summary_counts_it(self):
        self.backend({"B017": "built by make; proved by trace in CI"})
        self.assertEqual(self.check("--strict"), (0, "checked cpu/demo: status=validated abi=1\n"
                                                     "1 backend(s), 0 error(s), 0 warning(s), 1 "
                                                     "suppressed (--format json lists them)\n", ""))
        rc, out, err = self.check("--format", "json")
        report = json.loads(out)
        self.assertEqual((report["issues"], report["warnings"]), ([], 0))
        self.assertEqual([(d["code"], d["line"], d["reason"]) for d in report["suppressed"]],
                         [("B017", 2, "built by make; proved by trace in CI")])
        self.assertEqual(self.check("--format", "github")[1],
                         "1 backend(s), 0 error(s), 0 warning(s), 1 suppressed (--format json "
                         "lists them)\n")

    def test_without_the_entry_the_warning_fails_strict(self):
        self.backend()
        rc, out, err = self.check("--strict")
        self.assertEqual(rc, 1)
        self.assertIn("backends/cpu/demo/build.sh:2: [warning] B017 cpu/demo: cannot tell", out)

    def test_an_entry_that_matches_nothing_is_a_warning_at_its_line(self):
        text = self.backend({"B017": "built by make", "S006": "old"},
                            script=CPU_BUILD)
        rc, out, err = self.check()
        self.assertEqual((rc, err), (0, ""))
        line = manifest_line(text, '"B017"')
        self.assertEqual(out.splitlines()[:2], [
            "backends/cpu/demo/demo.backend.json:%d: [warning] M006 cpu/demo: ignore.B017 matches "
            "no warning of cpu/demo; remove the entry" % line,
            "backends/cpu/demo/demo.backend.json:%d: [warning] M006 cpu/demo: ignore.S006 matches "
            "no warning of cpu/demo; remove the entry" % (line + 1)])

    def test_an_error_is_never_suppressed(self):
        files_manifest = demo_manifest(abi_version=3)
        files_manifest["ignore"] = {"A001": "we know"}
        self.tree(demo_files(files_manifest))
        rc, out, err = self.check("--ignore", "A001")
        self.assertEqual(rc, 1)
        self.assertIn("[error] A001 cpu/demo: abi_version is 3", out)
        self.assertIn("[warning] M006 cpu/demo: ignore.A001 matches no warning of cpu/demo; A001 is "
                      "an error here, which no entry can suppress; remove the entry\n", out)

    def test_the_entries_of_the_tiers_codes_are_not_judged_by_check(self):
        self.backend({"B017": "built by make", "R007": "no driver on the CI runner"})
        rc, out, err = self.check()
        self.assertNotIn("M006", out)

    def test_a_bad_entry_is_an_error_of_the_manifest(self):
        text = self.backend({"b17": "typo", "B017": ""})
        rc, issues = self.issues()
        self.assertEqual(rc, 1)
        found = sorted((i["code"], i["line"], i["message"]) for i in issues)
        self.assertEqual(found, [
            ("B017", 2, "cannot tell which library build.sh writes: it has no compiler command "
                        "with -o that the checker can see; the checker does not follow line 2 "
                        "(make, whose build rules it does not read)"),
            ("M002", manifest_line(text, '"b17"'), '"ignore" maps codes to reasons; "b17" is no '
                                                  "code (a letter and three digits, as B017)"),
            ("M002", manifest_line(text, '"B017"'), '"ignore.B017" must be a non-empty string '
                                                    "saying why the warning is accepted, not \"\"")])

    def test_the_command_line_ignores_a_code_in_every_backend(self):
        self.backend()
        rc, out, err = self.check("--strict", "--ignore", "B017")
        self.assertEqual((rc, err), (0, ""))
        self.assertTrue(out.endswith(", 1 suppressed (--format json lists them)\n"), out)
        report = json.loads(self.check("--ignore", "B017", "--format", "json")[1])
        self.assertEqual([d["reason"] for d in report["suppressed"]], ["--ignore B017"])
        self.assertEqual(self.check("--ignore", "B17"), (
            2, "", "check_contract.py: error: argument --ignore: 'B17' is no diagnostic code; give "
            "one such as B017 (a letter and three digits); see check_contract.py check --help\n"))

    def test_a_tier_counts_what_it_suppresses(self):
        files = tiny_files()
        self.tree(files)
        rc, out, err = self.check("test")
        self.assertIn("[warning] U002 cpu/tiny: has no tests", out)
        rc, out, err = self.check("test", "--ignore", "U002")
        self.assertEqual((rc, err), (0, ""))
        self.assertNotIn("U002", out)
        self.assertTrue(out.endswith("0 backend(s) passed, 0 failed, 1 skipped, 1 suppressed "
                                     "(--format json lists them)\n"), out)
        files["backends/cpu/tiny/tiny.backend.json"]["ignore"] = {"U002": "tested by the server"}
        self.tree(files)
        rc, out, err = self.check("test", "--format", "json")
        (result,) = json.loads(out)["results"]
        self.assertEqual((result["issues"], [d["reason"] for d in result["suppressed"]]),
                         ([], ["tested by the server"]))

    def test_the_schema_knows_the_key(self):
        schema = load_schema()
        self.assertEqual(schema_errors(schema, demo_manifest(ignore={"B017": "proved by trace"})), [])
        for bad in ({"b17": "x"}, {"B017": ""}, {"B017": 1}):
            self.assertNotEqual(schema_errors(schema, demo_manifest(ignore=bad)), [], bad)

    def test_init_force_keeps_the_entries_of_the_manifest_it_replaces(self):
        self.backend({"B017": "built by make", "bad": "dropped"}, script=CPU_BUILD)
        rc, out, err = self.check("init", "--force", "--no-trace", self.path("backends/cpu/demo"))
        self.assertEqual(err, "")
        self.assertIn(" (keeping the ignore entries of the one it replaced: B017)\n", out)
        with open(self.path("backends/cpu/demo/demo.backend.json")) as handle:
            self.assertEqual(json.load(handle)["ignore"], {"B017": "built by make"})
        self.assertIn("[warning] M006 cpu/demo: ignore.B017 matches no warning", out)


class FindingLinesTest(TreeTest):
    """A finding about a manifest key or a script line carries the line."""

    def lines(self, manifest, **files):
        self.tree(demo_files(manifest, **files))
        text = json.dumps(manifest, indent=2)
        return text, {(i["code"], i["line"]) for i in self.issues()[1]}

    def test_manifest_keys_and_items_have_their_lines(self):
        manifest = demo_manifest(abi_version="1", colour=1, sources=["ops.h", "ops.c", "./ops.c"],
                                 models=["m/"])
        manifest["build"]["min_capabilty"] = 80
        del manifest["build"]["output"]
        text, found = self.lines(manifest)
        at = lambda needle: manifest_line(text, needle)
        self.assertLessEqual({("M002", at('"abi_version"')), ("M003", at('"colour"')),
                              ("M003", at('"min_capabilty"')), ("M001", at('"build"')),
                              ("S003", at('"./ops.c"')), ("O001", at('"m/"'))}, found)

    def test_a_tolerance_and_a_list_item_of_the_wrong_type(self):
        manifest = demo_manifest(excluded=["ok", 3])
        manifest["numerics"]["tolerance"]["rmsnorm_f32"] = -1
        text, found = self.lines(manifest)
        self.assertLessEqual({("M002", manifest_line(text, '"rmsnorm_f32"')),
                              ("M002", manifest_line(text, "    3\n"))}, found)

    def test_script_findings_point_at_the_compiler_call(self):
        files = fat_files(architectures=[80, 89, 90, 100])
        self.tree(files)
        rc, issues = self.issues()
        self.assertEqual([(i["code"], i["line"]) for i in issues], [("B006", 12)])
        files["backends/cuda/fat/build.sh"] = Executable(
            '#!/bin/sh\nmkdir -p "$1"\nif [ -d /opt/cuda ]; then a=80; else a=90; fi\n'
            'nvcc -shared -arch=sm_$a ops.cu -o "$1/libfat.so"\n')
        self.tree(files)
        rc, issues = self.issues()
        self.assertEqual({(i["code"], i["line"]) for i in issues}, {("B017", 4)})

    def test_windows_line_ends_point_at_the_first(self):
        self.tree(demo_files(**{"backends/cpu/demo/build.sh": Executable(
            CPU_BUILD.replace("set -euo pipefail\n", "set -euo pipefail\r\n"))}))
        rc, issues = self.issues()
        self.assertEqual([(i["code"], i["line"]) for i in issues], [("B012", 3)])


class OptionOrderTest(TreeTest):
    """What the docs say of option order and suggestions holds."""

    def test_format_and_json_may_come_before_the_command(self):
        self.tree(demo_files())
        listed = self.check("list", "--format", "json")
        self.assertEqual(listed[0], 0)
        for argv in (["--format", "json", "list"], ["--format=json", "list"], ["--json", "list"]):
            with self.subTest(argv=argv):
                self.assertEqual(self.check(*argv), listed)
        self.assertEqual(self.check("--format", "json", "cpu/demo"),
                         self.check("check", "cpu/demo", "--format", "json"))

    def test_a_mistyped_backend_is_suggested_before_a_command(self):
        self.tree({p.replace("cpu/demo/demo.", "cuda/fa_lite/fa_lite.").replace("cpu/demo/", "cuda/fa_lite/"): c
                   for p, c in demo_files().items()})
        rc, out, err = self.check("fa_lit")
        self.assertEqual((rc, out), (2, ""))
        self.assertEqual(err, 'check_contract.py: error: no backend named "fa_lit" under backends/ '
                              '(known: cuda/fa_lite); did you mean "fa_lite"?\n')

    def test_a_key_of_another_object_says_where_it_belongs(self):
        manifest = demo_manifest(min_capability=80)
        manifest["build"]["status"] = "validated"
        self.tree(demo_files(manifest))
        rc, issues = self.issues()
        self.assertEqual(sorted(i["message"] for i in issues if i["code"] == "M003"), [
            'unknown key "build.status"; it belongs at the top level (as "status")',
            'unknown key "min_capability"; it belongs under "build" (as "build.min_capability")'])


def git_in(root, *args):
    subprocess.run(["git", "-C", root, "-c", "user.name=t", "-c", "user.email=t@example.com"]
                   + list(args), check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


class RootTest(TreeTest):
    """Without --repo-root the root is found the way git finds its work tree."""

    def in_directory(self, rel, *args, env=None):
        saved = os.getcwd()
        os.chdir(self.path(rel))
        try:
            return run_main(list(args), env=env)
        finally:
            os.chdir(saved)

    def test_run_from_a_backend_directory_finds_the_root_holding_backends(self):
        self.tree(demo_files(**{"backends/cpu/demo/extra.c": ""}))
        rc, out, err = self.in_directory("backends/cpu/demo")
        self.assertEqual((rc, err), (1, ""))
        self.assertEqual(out, "extra.c: [error] S004 cpu/demo: kernel source extra.c is not declared "
                              "in sources; add it, or list it in excluded if it is not part of the "
                              "library\nchecked cpu/demo: status=validated abi=1\n"
                              "1 backend(s), 1 error(s), 0 warning(s)\n")

    def test_run_from_below_the_git_top_checks_the_whole_work_tree(self):
        self.tree(demo_files(**{"backends/cpu/demo/extra.c": "", "docs/x.md": ""}))
        git_in(self.root, "init", "-q")
        rc, out, err = self.in_directory("docs", "--format", "json")
        self.assertEqual((rc, err), (1, ""))
        self.assertEqual(json.loads(out)["checked"], ["cpu/demo"])
        self.assertEqual([(i["code"], i["path"]) for i in json.loads(out)["issues"]],
                         [("S004", "backends/cpu/demo/extra.c")])

    def test_repo_root_without_a_backends_directory_is_a_usage_error(self):
        self.tree(demo_files())
        rc, out, err = run_main(["--repo-root", self.path("backends")])
        self.assertEqual((rc, out), (2, ""))
        self.assertEqual(err, "check_contract.py: error: no backends directory: %s/backends/backends "
                              "is not there (the root is %s/backends, given by --root); give "
                              "--root DIR (the directory that holds backends/) or --backends-dir "
                              "DIR, or run from inside the repository\n" % (self.root, self.root))

    def test_no_backends_directory_from_here_up_is_a_usage_error(self):
        self.tree({"docs/x.md": ""})
        rc, out, err = self.in_directory("docs")
        self.assertEqual((rc, out), (2, ""))
        self.assertIn("error: no backends directory: %s/docs/backends is not there (the root is "
                      "%s/docs, the current directory; no directory from here up holds backends/)"
                      % (os.path.realpath(self.root), os.path.realpath(self.root)), err)

    def test_without_git_the_check_says_what_it_cannot_do(self):
        self.tree(demo_files(**{"backends/cpu/demo/build/gen.c": "", ".gitignore": "build/\n"}))
        git_in(self.root, "init", "-q")
        rc, out, err = run_main(["--repo-root", self.root], env={"PATH": ""})
        self.assertEqual(rc, 1)
        self.assertIn("S004 cpu/demo: kernel source build/gen.c is not declared", out)
        self.assertEqual(err, "check_contract.py: note: %s is in a git work tree but git cannot be "
                              "run; files git ignores are checked like the others, and B003 (the "
                              "build script's mode in the git index) is not checked\n" % self.root)
        self.assertEqual(self.check()[0], 0)


class GitIndexTest(TreeTest):
    """B003 wherever the build script and the backends directory are tracked."""

    def add_all(self, *not_executable):
        git_in(self.root, "init", "-q")
        git_in(self.root, "-c", "core.fileMode=false", "add", ".")
        for path in not_executable:
            git_in(self.root, "update-index", "--chmod=-x", path)

    def test_script_tracked_as_a_link_to_a_non_executable_file_is_an_error(self):
        files = demo_files()
        files["backends/cpu/demo/real.sh"] = files.pop("backends/cpu/demo/build.sh")
        self.tree(files)
        os.symlink("real.sh", self.path("backends/cpu/demo/build.sh"))
        self.add_all("backends/cpu/demo/real.sh")
        rc, out, err = self.check()
        self.assertEqual((rc, err), (1, ""))
        self.assertIn("backends/cpu/demo/build.sh: [error] B003 cpu/demo: build script build.sh is "
                      "tracked as a link to backends/cpu/demo/real.sh, which has mode 100644 in the "
                      "git index; run: git update-index --chmod=+x backends/cpu/demo/real.sh\n", out)

    def test_backends_dir_dot_reads_the_index(self):
        files = {p[len("backends/"):]: c for p, c in demo_files().items()}
        files["cpu/demo/demo.backend.json"] = demo_manifest(reference={"entrypoint": "cpu/demo/parity.py"})
        self.tree(files)
        self.add_all("cpu/demo/build.sh")
        rc, out, err = self.check("--backends-dir", ".")
        self.assertEqual((rc, err), (1, ""))
        self.assertIn("cpu/demo/build.sh: [error] B003 cpu/demo: build script build.sh has mode 100644 "
                      "in the git index; run: git update-index --chmod=+x cpu/demo/build.sh\n", out)

    def test_backends_tracked_as_a_link_reads_the_index_of_its_target(self):
        files = {p.replace("backends/", "kernels/", 1): c for p, c in demo_files().items()}
        self.tree(files)
        os.symlink("kernels", self.path("backends"))
        self.add_all("kernels/cpu/demo/build.sh")
        rc, out, err = self.check()
        self.assertEqual((rc, err), (1, ""))
        self.assertIn("backends/cpu/demo/build.sh: [error] B003 cpu/demo: build script build.sh has "
                      "mode 100644 in the git index; run: git update-index --chmod=+x "
                      "backends/cpu/demo/build.sh\n", out)


class WalkTest(TreeTest):
    """Every file a build could compile is declared, excluded, or an error."""

    def s004(self, path):
        return ("S004", "kernel source %s is not declared in sources; add it, or list it in "
                "excluded if it is not part of the library" % path)

    def test_hidden_directories_and_every_cxx_spelling_are_walked(self):
        names = ("k.c++", ".impl/k.cu", "a.inl", "a.hh", "a.hxx", "a.ipp", "a.tpp", "a.inc", "a.C")
        self.tree(demo_files(**{"backends/cpu/demo/" + n: "" for n in names}))
        rc, issues = self.issues()
        self.assertEqual(rc, 1)
        self.assertEqual(sorted((i["code"], i["message"]) for i in issues),
                         sorted(self.s004(n) for n in names))

    def test_declared_inline_file_is_read_for_the_abi_macro(self):
        manifest = demo_manifest(sources=["ops.h", "ops.c", "version.inl"])
        self.tree(demo_files(manifest, **{
            "backends/cpu/demo/ops.h": OPS_H.replace("#define DEMO_ABI_VERSION 1\n",
                                                     '#include "version.inl"\n'),
            "backends/cpu/demo/version.inl": "#define DEMO_ABI_VERSION 3\n"}))
        self.assertIssue("A001", "abi_version is 1 but version.inl defines DEMO_ABI_VERSION 3 (line 1); "
                         "make them equal")

    def test_kernel_source_directly_in_a_platform_directory_is_an_error(self):
        self.tree(demo_files(**{"backends/cpu/stray.c": "", "backends/cpu/notes.md": ""}))
        rc, out, err = self.check()
        self.assertEqual((rc, err), (1, ""))
        self.assertIn("backends/cpu/stray.c: [error] D005 cpu: kernel source stray.c lies "
                      "directly in the platform directory, where it belongs to no backend; move it "
                      "into a backend directory backends/cpu/<name>/\n", out)

    def test_directory_linked_out_of_the_backend_is_an_error_unless_excluded(self):
        self.tree(demo_files(**{"shared/common/x.cu": ""}))
        os.symlink("../../../shared/common", self.path("backends/cpu/demo/common"))
        rc, out, err = self.check()
        self.assertEqual((rc, err), (1, ""))
        self.assertIn("backends/cpu/demo/common: [error] S007 cpu/demo: common is a link to the "
                      "directory %s, outside the backend directory, whose files the check does not "
                      "see; move them into the backend directory, or list common in excluded if the "
                      "build does not use them\n" % os.path.realpath(self.path("shared/common")), out)
        self.tree(demo_files(demo_manifest(excluded=["common"])))
        self.assertClean()

    def test_backend_directory_linked_out_of_the_repository_is_not_walked(self):
        self.tree(demo_files())
        outside = tempfile.mkdtemp(prefix="check-contract-outside-")
        self.addCleanup(shutil.rmtree, outside, True)
        write_tree(outside, {"k.cu": ""})
        for name, target in (("ext", outside), ("root", "/")):
            os.symlink(target, self.path("backends/cpu/" + name))
        rc, out, err = self.check()
        self.assertEqual((rc, err), (1, ""))
        self.assertEqual(out.splitlines()[:2], [
            "backends/cpu/ext: [error] D006 cpu/ext: directory backends/cpu/ext is a symbolic link "
            "to %s, outside the repository; the check does not follow it (replace the link with "
            "the directory it stands for)" % os.path.realpath(outside),
            "backends/cpu/root: [error] D006 cpu/root: directory backends/cpu/root is a symbolic "
            "link to /, outside the repository; the check does not follow it (replace the link "
            "with the directory it stands for)"])

    def test_files_git_ignores_do_not_count(self):
        self.tree(demo_files(**{"backends/cpu/demo/build/CMakeFiles/probe.c": "",
                                "backends/cpu/demo/ops.hip.cpp": "", "backends/cpu/gen.c": "",
                                ".gitignore": "build/\n*.hip.cpp\n/backends/cpu/gen.c\n"}))
        rc, issues = self.issues()
        self.assertEqual(sorted(i["code"] for i in issues), ["D005", "S004", "S004"])
        git_in(self.root, "init", "-q")
        self.assertClean()



class AbiReadingTest(TreeTest):
    """The ABI macro is read where the preprocessor would take it from."""

    def with_header(self, header, **extra):
        self.tree(demo_files(**dict({"backends/cpu/demo/ops.h": header}, **extra)))

    def test_if_expressions_of_literals_are_evaluated(self):
        for condition in ("0 || 1", "0 + 1", "0 == 0", "0 \\\n    || 1", "(2 > 1) && !0", "true",
                          "1 ? 1 : 0", "0x10 >> 4"):
            with self.subTest(condition=condition):
                self.with_header("#if %s\n#define DEMO_ABI_VERSION 1\n#else\n#define DEMO_ABI_VERSION 9\n"
                                 "#endif\nuint32_t demo_abi_version(void);\n"
                                 "const char* demo_error_string(int code);\n" % condition)
                self.assertClean()

    def test_a_byte_order_mark_and_a_continued_line_comment_read_as_the_preprocessor_does(self):
        tail = "uint32_t demo_abi_version(void);\nconst char* demo_error_string(int code);\n"
        for header in (b"\xef\xbb\xbf#define DEMO_ABI_VERSION 1\n" + tail.encode(),
                       ("// the old value was \\\n#define DEMO_ABI_VERSION 9\n#define DEMO_ABI_VERSION 1\n"
                        + tail).encode()):
            with self.subTest(header=header):
                self.with_header(header)
                macros = subprocess.run(["gcc", "-E", "-dM", "-x", "c", self.path("backends/cpu/demo/ops.h")],
                                        stdout=subprocess.PIPE, universal_newlines=True, check=True).stdout
                self.assertEqual(re.findall(r"#define DEMO_ABI_VERSION (\w+)", macros), ["1"])
                self.assertClean()

    def test_only_an_if_whose_value_is_zero_is_dead(self):
        for condition in ("0", "false", "1 - 1", "0 && FOO", "(0)"):
            with self.subTest(condition=condition):
                self.with_header("#if %s\n#define DEMO_ABI_VERSION 9\n#else\n#define DEMO_ABI_VERSION 1\n"
                                 "#endif\nuint32_t demo_abi_version(void);\n"
                                 "const char* demo_error_string(int code);\n" % condition)
                self.assertClean()

    def test_branches_that_cannot_be_evaluated_both_count(self):
        for opening in ("#ifdef DEMO_V2", "#if DEMO_V2 > 1", "#if defined(DEMO_V2)", "#if 0\n#elifdef X",
                        "#if 0\n#elifndef X"):
            with self.subTest(opening=opening):
                header = ("%s\n#define DEMO_ABI_VERSION 2\n#else\n#define DEMO_ABI_VERSION 1\n#endif\n"
                          "uint32_t demo_abi_version(void);\nconst char* demo_error_string(int code);\n"
                          % opening)
                self.with_header(header)
                line = header.count("\n", 0, header.index("VERSION 2")) + 1
                self.assertIssue("A002", "several ABI versions are defined (ops.h:%d defines "
                                 "DEMO_ABI_VERSION 2, ops.h:%d defines DEMO_ABI_VERSION 1); keep "
                                 "exactly one" % (line, line + 2))

    def test_undef_and_redefinition_the_last_in_include_order_wins(self):
        manifest = demo_manifest(sources=["ops.h", "ops.c", "version.inl"])
        self.tree(demo_files(manifest, **{
            "backends/cpu/demo/ops.h": OPS_H.replace("#define DEMO_ABI_VERSION 1\n",
                                                     '#define DEMO_ABI_VERSION 3\n#include "version.inl"\n'),
            "backends/cpu/demo/version.inl": "#undef DEMO_ABI_VERSION\n#define DEMO_ABI_VERSION 1\n"}))
        self.assertClean()
        os.unlink(self.path("backends/cpu/demo/version.inl"))
        self.with_header(OPS_H.replace("#define DEMO_ABI_VERSION 1\n", "#define DEMO_ABI_VERSION 2\n"
                                       "#undef DEMO_ABI_VERSION\n#define DEMO_ABI_VERSION 1\n"))
        self.assertClean()

    def test_a_vendored_abi_macro_is_not_the_backends(self):
        for value in (1, 7):
            with self.subTest(value=value):
                manifest = demo_manifest(sources=["dlpack.h", "ops.h", "ops.c"])
                self.tree(demo_files(manifest, **{
                    "backends/cpu/demo/dlpack.h": "#define DLPACK_VERSION 80\n#define DLPACK_ABI_VERSION %d\n"
                                                  % value}))
                self.assertClean()

    def test_a_long_one_line_header_is_read_in_linear_time(self):
        line = "int x; #if 0 /* c */ \"s\" " * 110000
        self.with_header(OPS_H + line + "\n")
        with hang_guard("reading a 2.9 MB one-line header"):  # quadratic would take hours
            self.assertClean()



class NoTracebackTest(TreeTest):
    """Input that once ended in a traceback is a finding (exit 0, 1 or 2)."""

    def test_nul_or_surrogate_in_any_manifest_path_is_a_finding(self):
        expected = "a non-empty path (no NUL character, valid UTF-8)"
        for status in ("planned", "experimental"):
            for path, place in ((("sources",), "sources[2]"), (("build", "script"), "build.script"),
                                (("build", "output"), "build.output"),
                                (("reference", "entrypoint"), "reference.entrypoint"),
                                (("excluded",), "excluded[0]")):
                for bad in ("x\u0000.c", "x\udc80.c"):
                    with self.subTest(status=status, place=place, bad=bad):
                        manifest = with_value(demo_manifest(status=status), ("status",), status)
                        value = (["ops.h", "ops.c", bad] if path == ("sources",) else
                                 [bad] if path == ("excluded",) else bad)
                        self.tree(demo_files(with_value(manifest, path, value)))
                        rc, issues = self.issues()
                        self.assertEqual(rc, 1)
                        self.assertIn(("M002", '"%s" must be %s, not %s' % (place, expected, json.dumps(bad))),
                                      [(i["code"], i["message"]) for i in issues])
        self.tree(demo_files(demo_manifest(models=["m\u0000/"])))
        self.assertIssue("M002", '"models[0]" must be a directory relative to the repository root, '
                         'inside it, ending in /, not "m\\u0000/"')

    def test_integers_longer_than_python_reads_are_findings(self):
        huge = "1" + "0" * 5000
        for header in (OPS_H.replace("VERSION 1", "VERSION " + huge),
                       OPS_H.replace("VERSION 1", "VERSION 0x" + "f" * 5000)):
            self.tree(demo_files(**{"backends/cpu/demo/ops.h": header}))
            rc, issues = self.issues()
            self.assertEqual((rc, [i["code"] for i in issues]), (1, ["A005"]))
        shutil.rmtree(self.path("backends"))
        self.tree(fat_files(architectures=[80, 89, huge]))
        rc, issues = self.issues()
        self.assertEqual(rc, 1)
        self.assertIn(("B011", 'architecture "%s... is not a compute capability such as 89 or '
                       '"90a"' % huge[:36]), [(i["code"], i["message"]) for i in issues])
        shutil.rmtree(self.path("backends"))
        self.tree(demo_files(**{"backends/cpu/demo/demo.backend.json":
                                json.dumps(demo_manifest()).replace('"x86-64"]', '"x86-64", %s]' % huge, 1)}))
        self.assertEqual(self.codes(), ["J001"])
        build = str(CUDA_FAT_BUILD).replace("code=sm_89", "code=sm_89 -arch=sm_" + huge)
        shutil.rmtree(self.path("backends"))
        self.tree(dict(fat_files(), **{"backends/cuda/fat/build.sh": Executable(build)}))
        rc, out, err = self.check()
        self.assertEqual((rc, err), (1, ""))
        self.assertIn("[error] B007 cuda/fat: build.sh also builds 1000", out)

    def test_values_nested_a_thousand_deep_are_findings(self):
        for depth in (900, 1000, 5000):
            with self.subTest(depth=depth):
                text = json.dumps(demo_manifest())[:-1] + ', "description": %s}' % ("[" * depth + "]" * depth)
                self.tree(demo_files(**{"backends/cpu/demo/demo.backend.json": text}))
                for fmt in ("text", "json", "github"):
                    rc, out, err = self.check("--format", fmt)
                    self.assertEqual((rc, err), (1, ""))
                    self.assertTrue(re.search(r'J001|description\\?" must be a string', out), out[:300])
                # Which of the two depends on the interpreter's recursion limit.
                (issue,) = self.issues()[1]
                self.assertIn((issue["code"], issue["message"][:40]), [
                    ("J001", "invalid JSON: nested too deeply"),
                    ("M002", '"description" must be a string, not [[[[')])

    def test_report_to_a_full_disk_is_exit_2_with_the_reason(self):
        self.tree(demo_files())
        with open("/dev/full", "w") as full:
            done = subprocess.run([sys.executable, CHECKER, "--repo-root", self.root], stdout=full,
                                  stderr=subprocess.PIPE, universal_newlines=True)
        self.assertEqual((done.returncode, done.stderr),
                         (2, "check_contract.py: error: cannot write to standard output: No space left "
                             "on device; the report is incomplete\n"))

    def test_report_to_a_closed_pipe_is_exit_2_without_a_traceback(self):
        self.tree(demo_files(**{"backends/cpu/demo/k%04d.c" % i: "" for i in range(20)}))
        read_end, write_end = os.pipe()
        os.close(read_end)  # the reader is gone, as after `| head -1`
        try:
            done = subprocess.run([sys.executable, CHECKER, "--repo-root", self.root], stdout=write_end,
                                  stderr=subprocess.PIPE, universal_newlines=True)
        finally:
            os.close(write_end)
        self.assertEqual((done.returncode, done.stderr),
                         (2, "check_contract.py: error: cannot write to standard output: Broken pipe; "
                             "the report is incomplete\n"))



WORKFLOWS = os.path.join(HERE, ".github", "workflows")
CONTRACT_WORKFLOW = os.path.join(WORKFLOWS, "contract.yml")


def workflow_runs(path):
    """{job: [(step name or id, shell)]}: the `run:` steps of each job of a
    workflow, in order, read by this project's indentation (jobs at 2
    spaces, steps at 6, their keys at 8); ReusableWorkflowTest holds the
    reading to a YAML parser's."""
    with open(path, encoding="utf-8") as handle:
        lines = handle.read().split("\n")
    jobs, job, name, in_jobs = {}, None, None, False
    for n, line in enumerate(lines):
        if re.match(r"\S", line):
            job, in_jobs = None, line == "jobs:"
        elif in_jobs and re.match(r"  [\w-]+:$", line):
            job = jobs.setdefault(line.strip()[:-1], [])
        elif job is not None and line.startswith("      - "):
            name = None
        m = re.match(r"      [- ] (name|id|run): ?(.*)$", line) if job is not None else None
        if not m:
            continue
        key, value = m.groups()
        if key != "run":
            name = name or value
        elif value == "|":
            block = []
            for more in lines[n + 1:]:
                if more.strip() and not more.startswith(" " * 10):
                    break
                block.append(more[10:])
            job.append((name, "\n".join(block).rstrip("\n") + "\n"))
        else:
            job.append((name, value + "\n"))
    return jobs


def run_workflow_job(test, steps, cwd, env):
    """Run a job's `run:` steps as a GitHub runner does (bash -eo pipefail,
    GITHUB_ENV read after each step): {step: (exit status, output)} and the
    outputs the steps wrote; the test fails at the first step that fails."""
    env = dict(env)
    results, outputs = {}, {}
    for name, shell in steps:
        test.assertNotIn("${{", shell, "%s: an expression in the shell would not run here as on "
                                       "GitHub; pass it through env" % name)
        files = {key: os.path.join(env["RUNNER_TEMP"], key.lower()) for key in ("GITHUB_ENV", "GITHUB_OUTPUT")}
        for path in files.values():
            open(path, "w").close()
        done = subprocess.run(["bash", "--noprofile", "--norc", "-eo", "pipefail", "-c", shell],
                              cwd=cwd, env=dict(env, **files), stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, universal_newlines=True)
        results[name] = (done.returncode, done.stdout)
        test.assertEqual(done.returncode, 0, "step %r: %s" % (name, done.stdout))
        for key, target in (("GITHUB_ENV", env), ("GITHUB_OUTPUT", outputs)):
            with open(files[key]) as handle:
                target.update(line.split("=", 1) for line in handle.read().splitlines())
    return results, outputs


def runner_env(temp, **extra):
    """The environment of a job on a GitHub runner as far as the workflow's
    steps read it: `python` (setup-python's) on PATH, GITHUB_ACTIONS, RUNNER_TEMP."""
    bin_dir = os.path.join(temp, "bin")
    os.makedirs(bin_dir, exist_ok=True)
    for name in ("python", "python3"):
        if not os.path.lexists(os.path.join(bin_dir, name)):
            os.symlink(sys.executable, os.path.join(bin_dir, name))
    return dict(os.environ, PATH=bin_dir + os.pathsep + os.environ["PATH"], GITHUB_ACTIONS="true",
                RUNNER_TEMP=temp, **extra)


class WorkflowTest(TreeTest):
    """The steps of the reusable workflow (contract.yml) run here as on a runner."""

    def steps(self, job):
        return workflow_runs(CONTRACT_WORKFLOW)[job]

    def run_job(self, job, **env):
        temp = self.path("runner-temp")
        os.makedirs(temp, exist_ok=True)
        return run_workflow_job(self, self.steps(job), self.root,
                                runner_env(temp, ROOT=".", BACKENDS_DIR="backends", TOOL_REPOSITORY="",
                                           **env))

    def run_plan(self, files):
        self.tree(files)
        shutil.copy(CHECKER, self.path("check_contract.py"))
        results, outputs = self.run_job("plan")
        return results["list"][1], outputs

    def test_empty_compile_matrix_is_noticed(self):
        out, outputs = self.run_plan(demo_files(demo_manifest(status="planned")))
        self.assertEqual(outputs, {"matrix": '{"include":[]}', "any": "false"})
        self.assertIn("::notice title=compile::no buildable backend", out)

    def test_buildable_backend_makes_a_matrix(self):
        out, outputs = self.run_plan(demo_files())
        self.assertEqual(outputs["any"], "true")
        self.assertEqual(json.loads(outputs["matrix"])["include"][0]["name"], "demo")

    def test_a_hip_backend_is_in_the_matrix_the_compile_job_builds(self):
        # One compile job for every platform: a HIP backend gets the HIP image
        # (and hipcc, where that image lacks it) from its matrix entry.
        gpu = demo_manifest(name="gpu", platform="hip", status="experimental",
                            sources=["gpu.h", "k.hip"],
                            build={"script": "build.sh", "output": "libgpu.so",
                                   "architectures": ["gfx90a"]})
        out, outputs = self.run_plan({
            "backends/hip/gpu/gpu.backend.json": gpu,
            "backends/hip/gpu/gpu.h": OPS_H.replace("DEMO", "GPU").replace("demo", "gpu"),
            "backends/hip/gpu/k.hip": '#include "gpu.h"\n',
            "backends/hip/gpu/build.sh": Executable(
                '#!/bin/sh\nmkdir -p "$1"\nhipcc --offload-arch=gfx90a -shared -fPIC k.hip '
                '-o "$1/libgpu.so"\n')})
        self.assertEqual([(e["platform"], e["name"]) for e in json.loads(outputs["matrix"])["include"]],
                         [("hip", "gpu")])
        with open(CONTRACT_WORKFLOW, encoding="utf-8") as handle:
            image = re.search(r"\n    container:\n      image: (.*)\n", handle.read()).group(1)
        self.assertIn("matrix.platform == 'hip' && inputs.hip-image", image)
        tools = dict(self.steps("compile"))["Tools the build tier needs"]
        self.assertIn('[ "$PLATFORM" != hip ] || command -v hipcc', tools)


class WorkflowCredentialsTest(unittest.TestCase):
    def test_no_job_leaves_a_build_script_a_token(self):
        """A traced build script can read .git/config: no checkout persists the
        token there; the token reads only, but where the contract job uploads
        its SARIF to code scanning."""
        for name in sorted(os.listdir(WORKFLOWS)):
            with open(os.path.join(WORKFLOWS, name), encoding="utf-8") as handle:
                lines = handle.read().split("\n")
            checkouts = [n for n, line in enumerate(lines) if "uses: actions/checkout@" in line]
            self.assertTrue(checkouts, name)
            for n in checkouts:
                self.assertEqual(lines[n + 1].strip(), "with:", (name, n))
                self.assertTrue(lines[n + 2].strip().startswith("persist-credentials: false"), (name, n))
            granted = [(line.split(":", 1)[0].strip(), line.split(":", 1)[1].split("#")[0].strip())
                       for line in lines
                       if re.match(r"\s+(contents|actions|packages|id-token|pull-requests|checks|"
                                   r"statuses|deployments|issues|pages|security-events)\s*:", line)]
            if name == "ci.yml":
                self.assertEqual(lines[lines.index("permissions:") + 1], "  contents: read")
                self.assertEqual(sorted(set(granted)), [("contents", "read"), ("security-events", "write")])
                at = lines.index("      security-events: write  # the findings as SARIF, for code scanning")
                self.assertEqual(lines[at - 3:at - 1], ["  contract:", "    permissions:"])
                self.assertEqual(lines[at + 1], "    uses: ./.github/workflows/contract.yml")
            else:  # a called workflow narrows what its caller grants: a job running a script reads
                self.assertEqual(set(granted), {("contents", "read")}, name)
                for job in ("trace", "plan", "compile"):
                    at = lines.index("  %s:" % job)
                    self.assertIn("    permissions:\n      contents: read\n",
                                  "\n".join(lines[at:lines.index("    steps:", at)]) + "\n", job)


def readme_yaml(containing):
    """The ```yaml block of the README that contains `containing`."""
    with open(os.path.join(HERE, "README.md"), encoding="utf-8") as handle:
        blocks = re.findall(r"```yaml\n(.*?)```", handle.read(), re.S)
    return next(block for block in blocks if containing in block)


def venv_with(parent, package):
    """(a virtual environment under parent with `package` installed from
    PyPI, None) or (None, why it cannot be had)."""
    venv = os.path.join(parent, "venv")
    try:
        subprocess.run([sys.executable, "-m", "venv", venv], check=True,
                       stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    except (subprocess.CalledProcessError, OSError) as exc:
        return None, "cannot make a virtual environment for %s: %s" % (package, exc)
    done = subprocess.run([os.path.join(venv, "bin", "python"), "-m", "pip", "install", "--quiet",
                           "--disable-pip-version-check", package],
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, universal_newlines=True)
    if done.returncode:
        lines = done.stdout.strip().splitlines() or ["no output"]
        return None, "%s cannot be installed from PyPI: %s" % (package, lines[-1])
    return venv, None


class ReusableWorkflowTest(unittest.TestCase):
    """contract.yml as another repository uses it: the workflows and the
    README's caller validate against GitHub's workflow schema
    (check-jsonschema, installed from PyPI into a virtual environment once),
    and the steps its jobs run pass, run here as a runner runs them, on a
    repository with one CPU backend."""

    @classmethod
    def setUpClass(cls):
        cls.tmp = tempfile.mkdtemp(prefix="reusable-workflow-")
        cls.venv, cls.skip_reason = venv_with(cls.tmp, "check-jsonschema")

    @classmethod
    def tearDownClass(cls):
        shutil.rmtree(cls.tmp, ignore_errors=True)

    def validate(self, path):
        """(exit status, output) of check-jsonschema on the workflow at path."""
        if self.skip_reason:
            self.skipTest(self.skip_reason)
        done = subprocess.run([os.path.join(self.venv, "bin", "check-jsonschema"), "--builtin-schema",
                               "vendor.github-workflows", path], stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, universal_newlines=True)
        return done.returncode, done.stdout

    def load_yaml(self, path):
        """The workflow at path as the YAML parser check-jsonschema uses reads it."""
        self.validate(os.devnull)  # skips where the validator is missing
        done = subprocess.run([os.path.join(self.venv, "bin", "python"), "-c",
                               "import json, sys\nfrom ruamel.yaml import YAML\n"
                               "print(json.dumps(YAML(typ='safe').load(open(sys.argv[1]))))", path],
                              stdout=subprocess.PIPE, universal_newlines=True, check=True)
        return json.loads(done.stdout)

    def test_every_workflow_is_valid_against_githubs_schema(self):
        names = sorted(os.listdir(WORKFLOWS))
        self.assertEqual(names, ["ci.yml", "contract.yml"])
        for name in names:
            with self.subTest(workflow=name):
                self.assertEqual(self.validate(os.path.join(WORKFLOWS, name)), (0, "ok -- validation done\n"))

    def test_a_workflow_that_breaks_the_schema_is_refused(self):
        # so that the test above can fail: an input of an unknown type
        with open(CONTRACT_WORKFLOW, encoding="utf-8") as handle:
            text = handle.read()
        broken = os.path.join(self.tmp, "broken.yml")
        with open(broken, "w", encoding="utf-8") as handle:
            handle.write(text.replace("type: boolean", "type: bool", 1))
        rc, out = self.validate(broken)
        self.assertEqual(rc, 1, out)
        self.assertIn("Schema validation errors were encountered.", out)

    def test_the_steps_read_here_are_the_steps_yaml_reads(self):
        for name in sorted(os.listdir(WORKFLOWS)):
            path = os.path.join(WORKFLOWS, name)
            jobs = self.load_yaml(path)["jobs"]
            parsed = {job: [(step.get("name") or step.get("id"), step["run"].rstrip("\n") + "\n")
                            for step in body.get("steps", ()) if "run" in step]
                      for job, body in jobs.items()}
            with self.subTest(workflow=name):
                self.assertEqual(workflow_runs(path), parsed)

    def caller(self, sha):
        """The README's calling workflow with its placeholders filled in."""
        return readme_yaml("contract.yml@").replace("<owner>", "example").replace("<commit>", sha)

    def test_a_repository_calling_the_reusable_workflow_is_valid(self):
        repo = os.path.join(self.tmp, "caller")
        sha = "0123456789abcdef0123456789abcdef01234567"
        write_tree(repo, dict(tiny_files(), **{".github/workflows/kernels.yml": self.caller(sha)}))
        path = os.path.join(repo, ".github", "workflows", "kernels.yml")
        self.assertEqual(self.validate(path), (0, "ok -- validation done\n"))
        job = self.load_yaml(path)["jobs"]["contract"]
        self.assertEqual(job["uses"], "example/kernel-contract/.github/workflows/contract.yml@" + sha)
        self.assertEqual(job["with"], {"tool-repository": "example/kernel-contract", "tool-ref": sha})
        inputs = self.load_yaml(CONTRACT_WORKFLOW)["on"]["workflow_call"]["inputs"]
        self.assertLessEqual(set(job["with"]), set(inputs))
        self.assertEqual([name for name, spec in inputs.items() if spec.get("required")], [])

    def test_the_jobs_steps_pass_on_a_repository_with_one_cpu_backend(self):
        # Each job starts from a fresh checkout of the calling repository and
        # of the tool (as .kernel-contract), as on GitHub; `uses:` steps
        # (checkout, setup-python, the SARIF upload) are what this sets up.
        for tool in ("cc", "make", "git"):
            if not shutil.which(tool):
                self.skipTest("the local run of the workflow needs %s" % tool)
        work = tempfile.mkdtemp(prefix="caller-", dir=self.tmp)
        repo = os.path.join(work, "repo")
        sha = subprocess.run(["git", "rev-parse", "HEAD"], cwd=HERE, stdout=subprocess.PIPE,
                             universal_newlines=True).stdout.strip() or "0" * 40
        write_tree(repo, dict(tiny_files(), **{".github/workflows/kernels.yml": self.caller(sha)}))
        git = ["git", "-c", "user.name=t", "-c", "user.email=t@example.com"]
        subprocess.run(git + ["init", "-q"], cwd=repo, check=True)
        subprocess.run(git + ["add", "-A"], cwd=repo, check=True)
        subprocess.run(git + ["commit", "-qm", "caller"], cwd=repo, check=True)
        jobs = workflow_runs(CONTRACT_WORKFLOW)
        self.assertEqual(sorted(jobs), ["compile", "contract", "plan", "trace"])

        def run(job, **env):
            temp = tempfile.mkdtemp(prefix=job + "-", dir=work)
            os.makedirs(os.path.join(repo, ".kernel-contract"))
            shutil.copy(CHECKER, os.path.join(repo, ".kernel-contract", "check_contract.py"))
            results, outputs = run_workflow_job(self, jobs[job], repo, runner_env(
                temp, ROOT=".", BACKENDS_DIR="backends", TOOL_REPOSITORY="example/kernel-contract", **env))
            self.assertFalse(os.path.exists(os.path.join(repo, ".kernel-contract")))
            return temp, results, outputs

        temp, results, _ = run("contract")
        self.assertEqual(results["Backend contracts"], (0, "1 backend(s), 0 error(s), 0 warning(s)\n"))
        with open(os.path.join(temp, "contract.sarif")) as handle:
            sarif = json.load(handle)
        self.assertEqual((sarif["version"], sarif["runs"][0]["results"]), ("2.1.0", []))
        _, results, _ = run("trace")
        self.assertTrue(results["Build scripts traced"][1].endswith(
            "1 backend(s) passed, 0 failed, 0 skipped\n"), results)
        _, _, outputs = run("plan")
        self.assertEqual(outputs["any"], "true")
        matrix = json.loads(outputs["matrix"])["include"]
        self.assertEqual([(m["platform"], m["name"]) for m in matrix], [("cpu", "tiny")])
        temp, results, _ = run("compile", PLATFORM="cpu", BACKEND="cpu/tiny")
        self.assertEqual(results["Tools the build tier needs"], (0, ""))
        self.assertIn("\npassed cpu/tiny: exports tiny_abi_version", results["Build and inspect the binary"][1])
        self.assertTrue(os.path.isfile(os.path.join(temp, "build", "cpu", "tiny", "libtiny.so")))
        status = subprocess.run(["git", "status", "--porcelain"], cwd=repo, stdout=subprocess.PIPE,
                                universal_newlines=True, check=True).stdout
        self.assertEqual(status, "")


# -- Robustness and the schema ---------------------------------------------

VALUES = (None, 42, True, "x", [], {}, [1, 2], ["a", 3])
KEY_PATHS = [tuple(key.split(".")) for key, _, _ in check_contract.MANIFEST_KEYS] + \
            [("numerics", "tolerance", "rmsnorm_f32"), ("numerics", "tolerance", "note")]
SCHEMA_KEYWORDS = {"$schema", "$id", "title", "description", "type", "properties", "required",
                   "additionalProperties", "enum", "minimum", "minItems", "uniqueItems", "items",
                   "anyOf", "pattern", "minLength", "propertyNames"}
SHAPE_CODES = {"J003", "M001", "M002"}


def schema_errors(schema, value, where="$"):
    """The places where value breaks schema: a validator of exactly the keywords
    SCHEMA_KEYWORDS (JSON Schema draft 2020-12 semantics)."""
    errors = []
    kind = schema.get("type")
    types = {"object": lambda v: isinstance(v, dict), "array": lambda v: isinstance(v, list),
             "string": lambda v: isinstance(v, str),
             "integer": lambda v: isinstance(v, int) and not isinstance(v, bool)
             or isinstance(v, float) and v.is_integer(),
             "number": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool)}
    if kind and not types[kind](value):
        return [where + ": not " + kind]
    if "enum" in schema and not any(value == e and type(value) is type(e) for e in schema["enum"]):
        errors.append(where + ": not in enum")
    if "minimum" in schema and types["number"](value) and not value >= schema["minimum"]:
        errors.append(where + ": below minimum")
    if isinstance(value, str):
        if len(value) < schema.get("minLength", 0):
            errors.append(where + ": too short")
        pattern = schema.get("pattern")
        if pattern and not re.search(pattern.replace("$", r"\Z"), value):
            errors.append(where + ": pattern")
    if isinstance(value, list):
        if len(value) < schema.get("minItems", 0):
            errors.append(where + ": too few items")
        if schema.get("uniqueItems") and len({json.dumps(v, sort_keys=True) for v in value}) != len(value):
            errors.append(where + ": duplicate items")
        if "items" in schema:
            for index, item in enumerate(value):
                errors += schema_errors(schema["items"], item, "%s[%d]" % (where, index))
    if isinstance(value, dict):
        for key in schema.get("required", ()):
            if key not in value:
                errors.append(where + ": missing " + key)
        properties = schema.get("properties", {})
        for key in value if "propertyNames" in schema else ():
            errors += schema_errors(schema["propertyNames"], key, where + "." + key + " (name)")
        for key, item in value.items():
            if key in properties:
                errors += schema_errors(properties[key], item, where + "." + key)
            elif isinstance(schema.get("additionalProperties"), dict):
                errors += schema_errors(schema["additionalProperties"], item, where + "." + key)
    if "anyOf" in schema and all(schema_errors(s, value, where) for s in schema["anyOf"]):
        errors.append(where + ": matches no alternative")
    return errors


def load_schema():
    with open(SCHEMA_PATH) as handle:
        return json.load(handle)


def with_value(manifest, path, value):
    manifest = copy.deepcopy(manifest)
    target = manifest
    for key in path[:-1]:
        if not isinstance(target.get(key), dict):
            target[key] = {}
        target = target[key]
    target[path[-1]] = value
    return manifest


def many_backends(count):
    """`count` cpu backend directories, most of them broken in one of seven
    ways, plus broken cuda backends and an unknown platform directory."""
    files = {}
    for index in range(count):
        name = "d%03d" % index
        base = "backends/cpu/%s/" % name
        kind = index % 7
        manifest = demo_manifest(name=name, abi_version=2 if kind == 1 else 1)
        if kind == 6:
            manifest["min_capabilty"] = 80
        for path, content in demo_files(manifest).items():
            files[path.replace("backends/cpu/demo/demo.", base + name + ".")
                  .replace("backends/cpu/demo/", base)] = content
        files["backends/cpu/%s/parity.py" % name] = "print('ok')\n"
        if kind == 2:
            files[base + name + ".backend.json"] = '{"name": "%s",\n  "status": }' % name
        elif kind == 3:
            del files[base + name + ".backend.json"]
        elif kind == 4:
            files[base + "other.backend.json"] = "{}"
        elif kind == 5:
            files[base + "build.sh"] = str(CPU_BUILD)
        elif kind == 6:
            files[base + "extra.c"] = "int extra;\n"
    for index in range(count // 10):
        for path, content in fat_files(architectures=[80, 89]).items():
            files[path.replace("/fat/fat.backend.json", "/f%02d/f%02d.backend.json" % (index, index))
                  .replace("/fat/", "/f%02d/" % index)] = (
                dict(content, name="f%02d" % index) if isinstance(content, dict) else content)
    files["backends/tpu/x/ops.c"] = ""
    files["backends/npu/notes/README.md"] = ""
    return files


class RobustnessTest(TreeTest):
    def test_every_key_with_every_wrong_value_gives_diagnostics_not_tracebacks(self):
        schema = load_schema()
        for path in KEY_PATHS:
            for value in VALUES:
                manifest = with_value(demo_manifest(), path, value)
                with self.subTest(key=".".join(path), value=value):
                    shutil.rmtree(self.root)
                    os.mkdir(self.root)
                    self.tree(demo_files(manifest))
                    rc, out, err = self.check("--format", "json")
                    self.assertEqual(err, "")
                    self.assertIn(rc, (0, 1))
                    issues = json.loads(out)["issues"]
                    shape = {i["code"] for i in issues} & SHAPE_CODES
                    self.assertEqual(bool(shape), bool(schema_errors(schema, manifest)),
                                     (issues, schema_errors(schema, manifest)))

    def test_every_top_level_value_is_a_diagnostic(self):
        for value in VALUES:
            with self.subTest(value=value):
                self.tree(demo_files(**{"backends/cpu/demo/demo.backend.json": json.dumps(value)}))
                rc, out, err = self.check()
                self.assertEqual((rc, err), (1, ""))
                found = [(i["code"], i["message"]) for i in self.issues()[1]]
                if isinstance(value, dict):  # an object, without the keys a manifest needs
                    self.assertEqual(found, [("M001", 'missing required key "%s"' % key) for key in
                                             ("abi_version", "build", "name", "sources", "status")])
                else:
                    self.assertEqual(found, [("J003", "the manifest must be a JSON object, not %s"
                                              % json.dumps(value))])

    def test_binary_garbage_everywhere(self):
        garbage = bytes(range(256)) * 4
        files = demo_files(**{"backends/cpu/demo/ops.h": garbage, "backends/cpu/demo/ops.c": garbage,
                              "backends/cpu/demo/build.sh": garbage})
        self.tree(files)
        rc, out, err = self.check()
        self.assertEqual((rc, err), (1, ""))
        self.assertIn("backends/cpu/demo/ops.h: [warning] S006 cpu/demo: ops.h is not UTF-8 (first bad "
                      "byte at offset 128)\n", out)


FUZZ_VALUES = (None, 0, -1, 1, 2, 90, 1.5, float("nan"), True, "", "x", "../x", "/etc/passwd", "a/./b",
               "x\u0000.c", "x\udc80.c", "line\nbreak.c", "\x1b[2J", "ops.c", "build.sh", "*.c",
               "gfx942", "sm_90", "90a", "x86-64", [], {}, ["ops.c", "ops.c"], [80, "80"], {"note": 1},
               {"a": -1, "note": "x"}, "9" * 40, "é.cu", ["models/"], ["x/../../"])
FUZZ_NAMES = ("k.cu", "k.c++", ".impl/k.cu", "a\nb.c", "x.inl", "tests/test_x.py", "sub/deep/k.hh",
              "backend.json", "other.backend.json", "k.cuh", "\x7f.c", "\u2028.c", "build.sh")
FUZZ_LINES = ("#if 0 || 1", "#if 0", "#if (((1)))", "#if 1 ? 0 : 1", "#if 1 << 99", "#if 0x" + "f" * 40,
              "#if defined(X) && 0", "#if ((((((((((((((((((((((((((((((((((((((((((((((((((((((((((((((((((((1",
              "#elif 1", "#elifdef Y", "#else", "#endif", "#endif", "#undef DEMO_ABI_VERSION",
              "#define DEMO_ABI_VERSION 2", "#define DEMO_ABI_VERSION 0x1", "#define DEMO_ABI_VERSION (1u)",
              "#define DEMO_ABI_VERSION " + "7" * 30, "#define DLPACK_ABI_VERSION 9", '#include "ops.h"',
              '#include "../../x.h"', '#include "ops.c"', "#if 1 / 0", "#if -1 % 0", "#if ! ~ - + 1",
              "/* unterminated", "//", '"unterminated', "#if 1 \\", "uint32_t demo_abi_version(void);")
FUZZ_SCRIPT_LINES = ('cc -o "$1/libdemo.so" ops.c', "nvcc -arch=sm_" + "9" * 30 + ' -o "$1/x.so"',
                     'x=$x$x$x', "for a in 1 2; do", "done", "case $1 in", 'f() { cc -o "$1/y.so"; }',
                     '"${CC:-cc}" -march="${2:-x86-64}" -o "$1/libdemo.so" ops.c', "\r", "exit 1",
                     "cc -march=native -o /tmp/out.so", "eval \"$(cat x)\"", "make -C . OUT=$1")
FUZZ_ARGV = ((), ("--format", "json"), ("--format", "github"), ("--strict",), ("list",),
             ("list", "--buildable", "--format", "github-matrix"), ("list", "--format", "json"),
             ("check", "cpu/demo"), ("check", "demo/"), ("check", "metal"), ("chek",), ("--json", "list"),
             ("check", "a\nb"), ("--backends-dir", "."), ("--backends-dir", "backends/cpu"))


def fuzz_case(rng):
    """A tree of one or two backends, mutated at random, and the command line to check it."""
    files = demo_files()
    if rng.random() < 0.3:
        files.update(fat_files())
    manifest = demo_manifest()
    for _ in range(rng.randrange(4)):
        path = rng.choice(KEY_PATHS + [("colour",), ("build", "x")])
        if rng.random() < 0.2:
            target = manifest
            for key in path[:-1]:
                target = target.get(key) if isinstance(target.get(key), dict) else {}
            target.pop(path[-1], None)
        else:
            manifest = with_value(manifest, path, rng.choice(FUZZ_VALUES))
    text = json.dumps(manifest, indent=rng.choice((None, 2)))
    if rng.random() < 0.05:
        depth = rng.choice((500, 950, 1000, 3000))
        text = text.replace("{", '{"%s": %s, ' % (rng.choice(KEY_PATHS)[0], "[" * depth + "]" * depth), 1)
    choice = rng.random()
    if choice < 0.1:
        text = text[:rng.randrange(len(text) + 1)]
    elif choice < 0.15:
        text = "\ufeff" + text
    elif choice < 0.2:
        text = text.replace('"name"', '"name": "x", "name"', 1)
    files["backends/cpu/demo/demo.backend.json"] = text
    header = OPS_H.split("\n")
    for _ in range(rng.randrange(6)):
        header.insert(rng.randrange(len(header) + 1), rng.choice(FUZZ_LINES))
    files["backends/cpu/demo/ops.h"] = "\n".join(header)
    if rng.random() < 0.4:
        script = str(CPU_BUILD).split("\n")
        for _ in range(rng.randrange(1, 4)):
            script.insert(rng.randrange(len(script) + 1), rng.choice(FUZZ_SCRIPT_LINES))
        files["backends/cpu/demo/build.sh"] = Executable("\n".join(script))
    for _ in range(rng.randrange(3)):
        files["backends/cpu/demo/" + rng.choice(FUZZ_NAMES)] = rng.choice(("", "int x;\n", b"\xff\xfe"))
    if rng.random() < 0.1:
        files[rng.choice(("backends/cpu/stray.c", "backends/metal/m/m.cu", "backends/cuda/n/n.cu"))] = ""
    links = []
    if rng.random() < 0.15:
        links.append((rng.choice(("/", "..", "../..", "../../..", "ops.h", "missing", "loop")),
                      "backends/cpu/demo/" + rng.choice(("linked", "ops.c", "loop", "build.sh"))))
    return files, links, list(rng.choice(FUZZ_ARGV))


# A long run (LONG_TESTS=1) checks ten times as many fuzz cases; the default
# number keeps the suite fast enough to run before every commit.
FUZZ_CASES = 3000 if os.environ.get("LONG_TESTS") == "1" else 300


class Hung(BaseException):
    """Raised by hang_guard; not an Exception, so no handler of the code under test takes it."""


@contextlib.contextmanager
def hang_guard(what, seconds=120):
    """Turn a hang of the block into a failure that names `what`.  The bound
    is far above what the block takes on any machine (milliseconds to a few
    seconds): it measures no speed, it only stops a run that would not end."""
    def hung(signum, frame):
        raise Hung("%s did not end within %d s: a hang" % (what, seconds))
    previous = signal.signal(signal.SIGALRM, hung)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


class FuzzTest(TreeTest):
    def assertFuzzOutcome(self, case, argv, rc, out, err):
        """A usage error is one line on stderr (exit 2); a report is all on
        stdout, and its verdict is the exit status: 1 exactly when it counts
        an error, or any finding under --strict."""
        context = (case, argv, out[-500:], err)
        self.assertIn(rc, (0, 1, 2), context)
        self.assertNotIn("Traceback", err, context)
        if rc == 2:
            self.assertTrue(err.startswith("check_contract.py: error: "), context)
            self.assertEqual(err.count("\n"), 1, context)
            return
        self.assertEqual(err, "", context)
        if "list" in argv or "github" in argv:
            return
        if "json" in argv:
            issues = json.loads(out)["issues"]
            errors = sum(i["level"] == "error" for i in issues)
            warnings = len(issues) - errors
        else:
            summary = re.search(r" ([0-9]+) error\(s\), ([0-9]+) warning\(s\)\n\Z", out)
            self.assertIsNotNone(summary, context)
            errors, warnings = int(summary.group(1)), int(summary.group(2))
        self.assertEqual(rc, int(bool(errors or ("--strict" in argv and warnings))), context)

    def test_mutated_manifests_and_trees_never_crash_or_hang(self):
        """FUZZ_CASES mutated trees from a fixed seed, checked in-process:
        each ends in a usage error or a report whose exit status is its
        verdict, never in a traceback or a hang."""
        rng = random.Random(20261130)
        for case in range(FUZZ_CASES):
            files, links, argv = fuzz_case(rng)
            root = os.path.join(self.root, "r%d" % case)
            write_tree(root, files)
            for target, link in links:
                path = os.path.join(root, link)
                if os.path.lexists(path):
                    os.unlink(path)
                os.symlink(target, path)
            try:
                with hang_guard("case %d (%r)" % (case, argv)):
                    rc, out, err = run_main(["--repo-root", root] + argv)
            except BaseException as exc:  # a traceback: name the case that caused it
                self.fail("case %d (%r) raised %r" % (case, argv, exc))
            self.assertFuzzOutcome(case, argv, rc, out, err)
            shutil.rmtree(root)


class SchemaTest(unittest.TestCase):
    def test_schema_uses_only_the_keywords_the_validator_knows(self):
        used = set()

        def walk(node, in_properties=False):
            if isinstance(node, dict):
                for key, value in node.items():
                    if not in_properties:
                        used.add(key)
                    walk(value, key == "properties" and not in_properties)
            elif isinstance(node, list):
                for item in node:
                    walk(item)
        walk(load_schema())
        self.assertLessEqual(used, SCHEMA_KEYWORDS)
        self.assertEqual(load_schema()["$schema"], "https://json-schema.org/draft/2020-12/schema")

    def test_schema_and_checker_agree_on_the_fixture_manifests(self):
        schema = load_schema()
        good = [demo_manifest(), fat_files()["backends/cuda/fat/fat.backend.json"],
                demo_manifest(models=["m/"], excluded=["*.c"], description="d")]
        for manifest in good:
            self.assertEqual(schema_errors(schema, manifest), [])
        bad = [with_value(demo_manifest(), ("abi_version",), 0),
               with_value(demo_manifest(), ("build", "architectures"), []),
               with_value(demo_manifest(), ("models",), ["no-slash"]),
               with_value(demo_manifest(), ("name",), "Bad")]
        for manifest in bad:
            self.assertNotEqual(schema_errors(schema, manifest), [], manifest)

    def test_schema_documents_every_key_of_the_table_alike(self):
        """Each key of check_contract.MANIFEST_KEYS is a property of the
        schema, required there exactly when the table requires it, and the
        schema has no other property."""
        schema = load_schema()
        table = {key: required for key, required, _ in check_contract.MANIFEST_KEYS}
        found = {}

        def walk(node, where):
            for name, child in node.get("properties", {}).items():
                if where + name == "numerics.tolerance.note":
                    continue  # a value of the tolerance map, not a key of its own
                found[where + name] = name in node.get("required", ())
                walk(child, where + name + ".")
        walk(schema, "")
        self.assertEqual(found, table)


# -- The build, test and parity tiers --------------------------------------

TINY_H = """#include <stdint.h>
#define TINY_ABI_VERSION 2
uint32_t tiny_abi_version(void);
const char* tiny_error_string(int code);
"""

TINY_C = """#include "tiny.h"
uint32_t tiny_abi_version(void) { return %s; }
const char* tiny_error_string(int code) { return code == 0 ? "ok" : "bad argument"; }
"""

TINY_BUILD = Executable("""#!/bin/sh
set -eu
out_dir=$1
march=${2:-x86-64}
here=$(cd "$(dirname "$0")" && pwd)
mkdir -p "$out_dir"
echo "building for $march"
cc -shared -fPIC -march="$march" "$here/tiny.c" -o "$out_dir/libtiny.so"
""")


def tiny_files(version="TINY_ABI_VERSION", build=TINY_BUILD, c_source=None, status="experimental"):
    return {
        "backends/cpu/tiny/tiny.backend.json": {
            "name": "tiny", "abi_version": 2, "status": status, "sources": ["tiny.h", "tiny.c"],
            "build": {"script": "build.sh", "output": "libtiny.so", "architectures": ["x86-64"],
                      "default_arch": "x86-64"},
            "numerics": {"tolerance": {"add_f32": 0}},
            "reference": {"entrypoint": "backends/cpu/tiny/parity.py"}},
        "backends/cpu/tiny/tiny.h": TINY_H,
        "backends/cpu/tiny/tiny.c": c_source if c_source is not None else TINY_C % version,
        "backends/cpu/tiny/build.sh": build,
        "backends/cpu/tiny/parity.py": "print('max error 0 <= 0')\n",
    }


ELAPSED_LINE = re.compile(r"^\[ *[0-9]+\.[0-9]s\] ", re.M)


def ends(pid, timeout=60):
    """Whether process pid ends (a zombie awaiting its reaper has) within
    `timeout` seconds: a bound only a process nobody stopped reaches, however
    busy the machine."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            with open("/proc/%d/stat" % pid) as handle:
                state = handle.read().rsplit(")", 1)[1].split()[0]
        except FileNotFoundError:
            return True
        if state == "Z":
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)


def appears(path, timeout=60):
    """Whether path exists within `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while not os.path.exists(path):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


class BuildTierTest(TreeTest):
    def build(self, *args, env=None):
        return run_main(["--repo-root", self.root, "build", "--out", self.path("out")] + list(args),
                        env=env)

    def test_tiny_c_backend_builds_loads_and_passes(self):
        self.tree(tiny_files())
        rc, out, err = self.build()
        self.assertEqual((rc, err), (0, ""), out)
        self.assertIn("[    0.0s] building for x86-64\n", out.replace("[    0.1s]", "[    0.0s]"))
        self.assertRegex(out, r"\npassed cpu/tiny: exports tiny_abi_version and tiny_error_string; "
                              r"tiny_abi_version\(\) = 2 \([0-9.]+s\)\n1 backend\(s\) passed, 0 failed, 0 skipped\n\Z")
        self.assertTrue(os.path.isfile(self.path("out/cpu/tiny/libtiny.so")))

    def test_arch_is_passed_to_the_script(self):
        self.tree(tiny_files())
        rc, out, err = self.build("--arch", "x86-64-v2")
        self.assertEqual(rc, 0, out)
        self.assertRegex(out, r"\] building for x86-64-v2\n")

    def test_abi_mismatch_in_the_binary_is_an_error(self):
        self.tree(tiny_files(version="3"))
        rc, out, err = self.build("--format", "json")
        self.assertEqual(rc, 1)
        self.assertRegex(err, r"\] building for x86-64\n")
        result = json.loads(out)
        self.assertEqual((result["passed"], result["failed"], result["skipped"]), (0, 1, 0))
        self.assertEqual([(i["code"], i["message"]) for i in result["results"][0]["issues"]],
                         [("R006", "tiny_abi_version() in libtiny.so returns 3 but abi_version is 2")])

    def test_an_exported_name_without_the_prefix_is_an_error(self):
        self.tree(tiny_files(c_source=TINY_C % "TINY_ABI_VERSION" + "int helper(void) { return 1; }\n"
                             "static int hidden(void) { return 2; }\n"))
        rc, out, err = self.build("--format", "json")
        self.assertEqual(rc, 1, out)
        self.assertEqual([(i["code"], i["message"]) for i in json.loads(out)["results"][0]["issues"]], [
            ("R010", "libtiny.so exports 1 name(s) without the prefix tiny_ (helper), which the C ABI "
             "gives every name; hide them (-fvisibility=hidden, and "
             "__attribute__((visibility(\"default\"))) on the ABI's functions)")])

    def test_missing_symbol_is_an_error(self):
        self.tree(tiny_files(c_source='#include "tiny.h"\nuint32_t tiny_abi_version(void) { return 2; }\n'))
        rc, out, err = self.build()
        self.assertEqual(rc, 1)
        self.assertIn("\nbackends/cpu/tiny/build.sh: [error] R005 cpu/tiny: libtiny.so does not export "
                      "tiny_error_string\n", out)

    def test_failing_build_script_is_reported(self):
        self.tree(tiny_files(build=Executable(str(TINY_BUILD).replace(
            'echo "building for $march"',
            '[ -e /nonexistent ] || { echo "compiler exploded" >&2; exit 3; }'))))
        rc, out, err = self.build()
        self.assertEqual(rc, 1)
        self.assertRegex(out, r"\] compiler exploded\n")
        self.assertIn("\nfailed cpu/tiny: build script build.sh failed with exit status 3 (", out)
        self.assertTrue(out.endswith("\nbackends/cpu/tiny/build.sh: [error] R001 cpu/tiny: build script "
                                     "build.sh failed with exit status 3\n"
                                     "0 backend(s) passed, 1 failed, 0 skipped\n"), out)

    def test_build_that_runs_too_long_is_stopped(self):
        pid_file = self.path("sleeper.pid")
        self.tree(tiny_files(build=Executable(str(TINY_BUILD).replace(
            'echo "building for $march"', 'sleep 60 & echo $! > %s; wait' % pid_file))))
        rc, out, err = self.build("--timeout", "1")
        self.assertEqual(rc, 1)
        self.assertIn("\nbackends/cpu/tiny/build.sh: [error] R002 cpu/tiny: build script build.sh did not "
                      "finish within 1s; it was stopped\n", out)
        with open(pid_file) as handle:
            sleeper = int(handle.read())
        self.assertTrue(ends(sleeper), "the build's background process outlived the time limit")

    def test_output_that_is_not_a_shared_object_is_an_error(self):
        self.tree(tiny_files(build=Executable(
            '#!/bin/sh\nmarch=${2:-x86-64}\nmkdir -p "$1"\ncc -march=$march -shared -o "$1/libtiny.so" -x c /dev/null\n'
            'printf \'not a library\\n\' > "$1/libtiny.so"\n')))
        rc, out, err = self.build()
        self.assertEqual(rc, 1)
        self.assertIn("\nbackends/cpu/tiny/build.sh: [error] R004 cpu/tiny: libtiny.so is not a usable "
                      "shared object: not an ELF file\n", out)

    def test_missing_output_is_an_error(self):
        self.tree(tiny_files(build=Executable(
            '#!/bin/sh\nmarch=${2:-x86-64}\nmkdir -p "$1"\n'
            'if [ -e /nonexistent ]; then cc -march=$march -o "$1/libtiny.so"; fi\n')))
        rc, out, err = self.build()
        self.assertEqual(rc, 1)
        self.assertIn("\nbackends/cpu/tiny/build.sh: [error] R003 cpu/tiny: the build did not write "
                      "libtiny.so (build.output) into its "
                      "output directory\n", out)

    def test_missing_toolchain_is_skipped_with_the_reason(self):
        self.tree(tiny_files())
        rc, out, err = self.build(env={"CC": "/nonexistent/cc"})
        self.assertEqual((rc, out), (0, "skipped cpu/tiny: /nonexistent/cc not found (set CC or put cc "
                                        "on PATH)\n0 backend(s) passed, 0 failed, 1 skipped\n"))

    def test_backend_with_contract_errors_is_not_built(self):
        files = tiny_files()
        files["backends/cpu/tiny/extra.c"] = ""
        self.tree(files)
        rc, out, err = self.build()
        self.assertEqual(rc, 1)
        self.assertIn("failed cpu/tiny: not buildable: the contract check reports 1 error(s); run "
                      "check_contract.py check cpu/tiny\n", out)

    def test_planned_backend_is_skipped(self):
        self.tree(tiny_files(status="planned"))
        self.assertEqual(self.build(), (0, "skipped cpu/tiny: status is planned\n"
                                           "0 backend(s) passed, 0 failed, 1 skipped\n", ""))

    def test_bad_timeout_is_a_usage_error(self):
        self.tree(tiny_files())
        rc, out, err = self.build("--timeout", "0")
        self.assertEqual((rc, out), (2, ""))
        self.assertIn("argument --timeout: must be a number of seconds > 0, not '0'", err)


NVCC = shutil.which("nvcc")

TINY_CU = """#include <cstdint>
#include <cuda_runtime.h>
#define GPUTINY_ABI_VERSION 1
#define GPUTINY_API extern "C" __attribute__((visibility("default")))
GPUTINY_API uint32_t gputiny_abi_version(void) { return GPUTINY_ABI_VERSION; }
GPUTINY_API const char* gputiny_error_string(int code) { return code ? "bad argument" : "ok"; }
__global__ void twice(float* x, int n) { int i = threadIdx.x; if (i < n) x[i] *= 2.0f; }
GPUTINY_API int gputiny_twice(float* x, int n, cudaStream_t stream) {
    twice<<<1, 32, 0, stream>>>(x, n);
    return 0;
}
"""

GPU_BUILD = Executable("""#!/bin/bash
set -euo pipefail
out_dir=$1
cap=${2:-80}
mkdir -p "$out_dir"
"${NVCC:-nvcc}" -shared -Xcompiler -fPIC,-fvisibility=hidden -gencode "arch=compute_${cap},code=sm_${cap}" ${EXTRA_GENCODE:-} \\
    "$(dirname "$0")/tiny.cu" -o "$out_dir/libgputiny.so"
""")


@unittest.skipUnless(NVCC, "nvcc is not installed, so no CUDA fixture can be built")
class CudaBuildTierTest(TreeTest):
    def setUp(self):
        super().setUp()
        self.tree({
            "backends/cuda/gputiny/gputiny.backend.json": {
                "name": "gputiny", "abi_version": 1, "status": "experimental", "sources": ["tiny.cu"],
                "build": {"script": "build.sh", "output": "libgputiny.so", "architectures": [80],
                          "default_arch": 80}},
            "backends/cuda/gputiny/tiny.cu": TINY_CU,
            "backends/cuda/gputiny/build.sh": GPU_BUILD})

    def build(self, extra):
        return run_main(["--repo-root", self.root, "build", "--out", self.path("out")],
                        env={"EXTRA_GENCODE": extra})

    def test_fatbinary_targets_match_the_manifest(self):
        rc, out, err = self.build("")
        self.assertEqual(rc, 0, out)
        self.assertRegex(out, r"\npassed cuda/gputiny: exports gputiny_abi_version and "
                              r"gputiny_error_string; gputiny_abi_version\(\) = 1; SASS 80 \(")

    def test_fatbinary_with_an_unclaimed_target_is_an_error(self):
        rc, out, err = self.build("-gencode arch=compute_75,code=sm_75")
        self.assertEqual(rc, 1, out)
        self.assertIn("\nbackends/cuda/gputiny/build.sh: [error] R008 cuda/gputiny: the fatbinary of "
                      "libgputiny.so holds SASS for 75, 80 but "
                      "build.architectures is 80\n", out)

    def test_the_device_link_stub_of_a_link_step_is_no_target(self):
        # nvcc's link step adds a cubin for its default architecture (sm_75
        # with CUDA 13) that holds no kernel: the library runs only on 80.
        self.tree({"backends/cuda/gputiny/build.sh": Executable(
            '#!/bin/bash\nset -eu\nmkdir -p "$1"\ncd "$(dirname "$0")"\n'
            'nvcc -c -Xcompiler -fPIC,-fvisibility=hidden -gencode arch=compute_80,code=sm_80 '
            'tiny.cu -o "$1/tiny.o"\nnvcc -shared "$1/tiny.o" -o "$1/libgputiny.so"\n')})
        rc, out, err = self.build("")
        self.assertEqual(rc, 0, out)
        self.assertIn("; SASS 80 (", out)
        shared = check_contract.read_shared_object(self.path("out/cuda/gputiny/libgputiny.so"))
        self.assertEqual(check_contract.cuda_targets(shared), ({"80"}, set(), set()))

    def test_a_compressed_cubin_outside_the_manifest_cannot_be_told(self):
        self.tree({"backends/cuda/gputiny/build.sh": Executable(
            '#!/bin/bash\nset -eu\nmkdir -p "$1"\ncd "$(dirname "$0")"\n'
            'nvcc -c -Xcompiler -fPIC,-fvisibility=hidden -gencode arch=compute_80,code=sm_80 '
            'tiny.cu -o "$1/tiny.o"\nnvcc -shared -Xfatbin -compress-all "$1/tiny.o" '
            '-o "$1/libgputiny.so"\n')})
        rc, out, err = self.build("")
        self.assertEqual(rc, 0, out)
        self.assertIn("\nbackends/cuda/gputiny/build.sh: [warning] R011 cuda/gputiny: cannot tell "
                      "whether the compressed SASS for 75 in libgputiny.so holds kernels or only "
                      "nvcc's device-link stub; build with nvcc -compress-mode=none to have it "
                      "read\n", out)


def cubin_with_a_kernel():
    """The least cubin the reader takes for machine code with a kernel: an
    ELF header, one symbol table section, one function symbol in it."""
    import struct
    header = bytearray(64)
    header[:6] = check_contract.ELF_MAGIC + b"\x02\x01"
    struct.pack_into("<Q", header, 40, 64)  # the section headers' offset
    struct.pack_into("<HH", header, 58, 64, 1)  # their size and count
    section = struct.pack("<IIQQQQIIQQ", 0, check_contract.SECTION_SYMTAB, 0, 0, 128, 24, 0, 0, 8, 24)
    symbol = struct.pack("<IBBHQQ", 0, 0x10 | check_contract.SYMBOL_FUNCTION, 0, 1, 0, 16)
    return bytes(header) + section + symbol


def fatbin_entry(kind, target, flags=0, payload=None):
    """One entry of a fatbinary container as nvcc writes it: a 64-byte header
    (kind, header size, payload size, the target at 28, the flags at 40),
    then the payload (by default a cubin with a kernel for SASS, text for PTX)."""
    import struct
    if payload is None:
        payload = cubin_with_a_kernel() if kind == check_contract.FATBIN_KIND_SASS else b".version 9.0\n"
    header = bytearray(64)
    struct.pack_into("<HHIQ", header, 0, kind, 0x101, len(header), len(payload))
    struct.pack_into("<I", header, 28, target)
    struct.pack_into("<Q", header, 40, flags)
    return bytes(header) + payload


def fatbin_container(*entries):
    import struct
    body = b"".join(entries)
    return struct.pack("<IHHQ", check_contract.FATBIN_MAGIC, 1, 16, len(body)) + body


def fatbin_section(*containers):
    """The containers as they sit in .nv_fatbin: each at an 8-byte boundary."""
    section = b""
    for container in containers:
        section += b"\0" * (-len(section) % 8) + container
    return section


class FatbinReaderTest(unittest.TestCase):
    """The fatbinary reader on containers written here: no compiler needed."""

    SASS, PTX = check_contract.FATBIN_KIND_SASS, check_contract.FATBIN_KIND_PTX

    def targets(self, section, named=True):
        """What the reader finds in `section`, in a library whose section
        headers name .nv_fatbin, or (named=False) stripped of them.  The
        section starts at an 8-byte boundary of the file, as in an ELF file."""
        before = b"\x7fELF host code!!"
        sections = {".nv_fatbin": (len(before), len(section))} if named else {}
        return check_contract.cuda_targets(check_contract.SharedObject(
            before + section + b"\0" * 8, sections, set()))

    def test_arch_specific_and_family_targets_keep_their_suffix(self):
        section = fatbin_section(fatbin_container(
            fatbin_entry(self.SASS, 80), fatbin_entry(self.SASS, 90, check_contract.FATBIN_ARCH_SPECIFIC),
            fatbin_entry(self.SASS, 100, check_contract.FATBIN_FAMILY),
            fatbin_entry(self.PTX, 90, check_contract.FATBIN_ARCH_SPECIFIC)))
        for named in (True, False):
            with self.subTest(named=named):
                self.assertEqual(self.targets(section, named), ({"80", "90a", "100f"}, {"90a"}, set()))

    def test_the_container_after_an_odd_sized_one_is_read_at_the_next_8_byte_boundary(self):
        first = fatbin_container(fatbin_entry(self.SASS, 80, payload=cubin_with_a_kernel() + b"\xaa" * 5))
        self.assertNotEqual(len(first) % 8, 0)
        section = fatbin_section(first, fatbin_container(fatbin_entry(self.SASS, 90),
                                                         fatbin_entry(self.PTX, 90)))
        self.assertEqual(self.targets(section), ({"80", "90"}, {"90"}, set()))

    @unittest.skipUnless(NVCC, "nvcc is not installed, so no real fatbinary can be made")
    def test_a_library_nvcc_builds_for_sm_90a_is_read_as_90a(self):
        root = tempfile.mkdtemp(prefix="check-contract-")
        self.addCleanup(shutil.rmtree, root, True)
        write_tree(root, {"tiny.cu": TINY_CU})
        subprocess.run([NVCC, "-shared", "-Xcompiler", "-fPIC", "-gencode",
                        "arch=compute_80,code=sm_80", "-gencode", "arch=compute_90a,code=[sm_90a,compute_90a]",
                        os.path.join(root, "tiny.cu"), "-o", os.path.join(root, "libtiny.so")],
                       check=True, stdout=subprocess.DEVNULL)
        library = check_contract.read_shared_object(os.path.join(root, "libtiny.so"))
        self.assertEqual(check_contract.cuda_targets(library), ({"80", "90a"}, {"90a"}, set()))


@unittest.skipUnless(NVCC, "nvcc is not installed, so what it builds cannot be compared with the trace")
class NvccModelTest(TreeTest):
    """What the trace reads of nvcc's calls against what the real nvcc put
    into the library (the fatbin reader as the oracle)."""

    def script(self, body, architectures=(80,)):
        self.tree({
            "backends/cuda/gputiny/gputiny.backend.json": {
                "name": "gputiny", "abi_version": 1, "status": "experimental", "sources": ["tiny.cu"],
                "build": {"script": "build.sh", "output": "libgputiny.so",
                          "architectures": list(architectures)}},
            "backends/cuda/gputiny/tiny.cu": TINY_CU,
            "backends/cuda/gputiny/build.sh": Executable(
                '#!/bin/bash\nset -eu\nmkdir -p "$1"\nout=$(cd "$1" && pwd)\ncd "$(dirname "$0")"\n'
                + body)})

    def built_and_traced(self):
        """(the SASS targets of the real build, the trace's targets, the trace's findings)."""
        rc, out, err = run_main(["--repo-root", self.root, "build", "--out", self.path("out")])
        shared = check_contract.read_shared_object(self.path("out/cuda/gputiny/libgputiny.so"))
        rc, out, err = run_main(["--repo-root", self.root, "trace", "--format", "json"])
        (result,) = json.loads(out)["results"]
        found = sorted((i["code"], i["message"]) for i in result["issues"]
                       if i["message"].startswith("running build.sh <output-dir> shows: "))
        return sorted(check_contract.cuda_targets(shared)[0]), result["runs"][0]["targets"], found

    LIBRARY = ('nvcc -shared -Xcompiler -fPIC,-fvisibility=hidden -gencode arch=compute_80,code=sm_80 '
               '%s tiny.cu -o "$out/libgputiny.so"\n')

    def test_nvcc_append_flags_add_their_targets(self):
        self.script('export NVCC_APPEND_FLAGS="-gencode arch=compute_90,code=sm_90"\n'
                    + self.LIBRARY % "", architectures=(80, 90))
        real, traced, found = self.built_and_traced()
        self.assertEqual((real, sorted(traced), found), (["80", "90"], ["80", "90"], []))
        self.tree({"backends/cuda/gputiny/gputiny.backend.json": {
            "name": "gputiny", "abi_version": 1, "status": "experimental", "sources": ["tiny.cu"],
            "build": {"script": "build.sh", "output": "libgputiny.so", "architectures": [80]}}})
        self.assertIssue("B007", "build.sh also builds 90, which build.architectures does not list; "
                         "list it (the build tier rejects a library with targets the manifest does "
                         "not name, R008)")

    def test_nvcc_prepend_flags_given_to_one_call_add_their_targets(self):
        self.script("NVCC_PREPEND_FLAGS=-gencode=arch=compute_90,code=sm_90 " + self.LIBRARY % "",
                    architectures=(80, 90))
        real, traced, found = self.built_and_traced()
        self.assertEqual((real, sorted(traced), found), (["80", "90"], ["80", "90"], []))

    def test_an_options_file_adds_its_targets(self):
        self.script('opts=$(mktemp)\nprintf -- \'-gencode "arch=compute_90,code=sm_90"\\n\' > "$opts"\n'
                    + self.LIBRARY % '-optf "$opts"' + 'rm -f "$opts"\n', architectures=(80, 90))
        real, traced, found = self.built_and_traced()
        self.assertEqual((real, sorted(traced), found), (["80", "90"], ["80", "90"], []))

    def test_objects_the_link_does_not_take_are_no_targets(self):
        # The link's own -arch builds only its device-link stub; other.o never reaches the library.
        self.script('echo "__global__ void other() {}" > "$out/other.cu"\n'
                    'nvcc -c -gencode arch=compute_90,code=sm_90 "$out/other.cu" -o "$out/other.o"\n'
                    'nvcc -c -Xcompiler -fPIC,-fvisibility=hidden -gencode arch=compute_80,code=sm_80 '
                    'tiny.cu -o "$out/tiny.o"\n'
                    'nvcc -shared -arch=sm_89 "$out/tiny.o" -o "$out/libgputiny.so"\n')
        real, traced, found = self.built_and_traced()
        self.assertEqual((real, traced, found), (["80"], ["80"], []))
        self.assertClean()

    def test_a_link_of_an_archive_no_call_wrote_cannot_be_told_apart(self):
        self.script('nvcc -c -Xcompiler -fPIC -gencode arch=compute_80,code=sm_80 tiny.cu -o "$out/t.o"\n'
                    'nvcc -c -gencode arch=compute_90,code=sm_90 tiny.cu -o "$out/u.o"\n'
                    'ar rcs "$out/libt.a" "$out/t.o"\n'
                    'nvcc -shared "$out/libt.a" -o "$out/libgputiny.so"\n')
        rc, out, err = run_main(["--repo-root", self.root, "trace", "--format", "json"])
        self.assertEqual(json.loads(out)["results"][0]["runs"][0]["targets"], ["80", "90"])

    def test_a_target_the_machines_nvcc_does_not_support_is_refused(self):
        # CUDA 13 dropped sm_70: the real build fails, and so must the trace.
        listed = subprocess.run([NVCC, "--list-gpu-code"], stdout=subprocess.PIPE,
                                universal_newlines=True, check=True).stdout.split()
        if "sm_70" in listed:
            self.skipTest("this nvcc still builds sm_70")
        self.script(self.LIBRARY % "-arch=sm_70", architectures=(70, 80))
        rc, out, err = run_main(["--repo-root", self.root, "build", "--out", self.path("out")])
        self.assertIn("nvcc fatal   : Unsupported gpu architecture 'sm_70'", out)
        self.assertEqual(rc, 1, out)
        release = re.search(r"release ([0-9.]+),", subprocess.run(
            [NVCC, "--version"], stdout=subprocess.PIPE, universal_newlines=True).stdout).group(1)
        numbers = sorted((int(c[3:]) for c in listed if c.startswith("sm_")))
        rc, out, err = run_main(["--repo-root", self.root, "trace", "--format", "json"])
        self.assertIn({"level": "error", "code": "B018", "backend": "cuda/gputiny",
                       "path": "backends/cuda/gputiny/build.sh", "line": None,
                       "message": "running build.sh <output-dir> shows: build.sh builds with sm_70, "
                       "which the machine's nvcc (release %s) does not support (nvcc "
                       "--list-gpu-code lists sm_%d to sm_%d); list only targets it builds"
                       % (release, numbers[0], numbers[-1])}, json.loads(out)["results"][0]["issues"])
        self.assertEqual(rc, 1, out)

    def test_the_shims_nvcc_answers_as_the_machines(self):
        real = [subprocess.run([NVCC, option], stdout=subprocess.PIPE, universal_newlines=True,
                               check=True).stdout.strip() for option in ("--version", "--list-gpu-code")]
        self.script('[ "$(nvcc --version)" = %s ]\n[ "$(nvcc --list-gpu-code)" = %s ]\n'
                    % tuple(shlex.quote(r) for r in real) + self.LIBRARY % "")
        rc, out, err = run_main(["--repo-root", self.root, "trace"])
        self.assertEqual(rc, 0, out)

    def test_a_missing_options_file_fails_as_nvcc_fails(self):
        self.script(self.LIBRARY % "--options-file=nowhere.txt")
        rc, out, err = run_main(["--repo-root", self.root, "trace"])
        self.assertEqual(rc, 1, out)
        self.assertIn("nvcc fatal   : Could not open options file 'nowhere.txt'", out)
        self.assertIn("[error] R001 cuda/gputiny: running build.sh <output-dir> shows: the script "
                      "failed with exit status 1\n", out)


def offload_bundle(entries):
    """A clang offload bundle of (id, code object) entries, laid out as clang
    lays it out: the header table, then each code object 4096-aligned."""
    import struct
    header = len(check_contract.BUNDLE_MAGIC) + 8 + sum(24 + len(i) for i, _ in entries)
    table, objects, offset = [], b"", header
    for entry_id, code in entries:
        if code:
            offset = (offset + 4095) & ~4095
        table.append(struct.pack("<QQQ", offset, len(code), len(entry_id)) + entry_id.encode())
        objects += b"\0" * (offset - header - len(objects)) + code
        offset += len(code)
    return check_contract.BUNDLE_MAGIC + struct.pack("<Q", len(entries)) + b"".join(table) + objects


def hip_bundle(*targets):
    """A bundle for the targets, with the empty host entry hipcc writes."""
    code = b"\x7fELF\x02\x01\x01@" + b"\xaa" * 56  # the reader reads ids, not code objects
    return offload_bundle([("hipv4-amdgcn-amd-amdhsa--" + t, code) for t in targets]
                          + [("host-x86_64-unknown-linux", b"")])


def compressed_bundle(bundle, method, version=2):
    """A CCOB header and the bundle compressed: zlib, or zstd as a frame of
    one raw (stored) block, which any zstd decoder reads."""
    import hashlib
    import struct
    import zlib
    if method == check_contract.COMPRESSION_ZLIB:
        payload = zlib.compress(bundle)
    else:
        payload = (struct.pack("<IBI", 0xFD2FB528, 0xA0, len(bundle))
                   + struct.pack("<I", (len(bundle) << 3) | 1)[:3] + bundle)
    digest = hashlib.md5(bundle).digest()[:8]
    header = 4 + 4 + struct.calcsize(check_contract.COMPRESSED_BUNDLE_SIZES[version]) + 8
    sizes = {1: (len(bundle),), 2: (header + len(payload), len(bundle)),
             3: (header + len(payload), len(bundle))}[version]
    return (check_contract.COMPRESSED_BUNDLE_MAGIC + struct.pack("<HH", version, method)
            + struct.pack(check_contract.COMPRESSED_BUNDLE_SIZES[version], *sizes) + digest + payload)


def hip_fatbin(*bundles):
    """The bundles as they sit in .hip_fatbin: each at a 4096 boundary."""
    section = b""
    for bundle in bundles:
        section += b"\0" * (-len(section) % 4096) + bundle
    return section


def hip_fatbin_library(section, before=b"\x7fELF host code"):
    """A SharedObject holding the section after some other bytes."""
    return check_contract.SharedObject(before + section, {".hip_fatbin": (len(before), len(section))},
                                       set())


def clang_offload_bundler():
    """clang's bundler, the independent reader of offload bundles, or None."""
    import glob
    found = shutil.which("clang-offload-bundler")
    return found or next(iter(sorted(glob.glob("/usr/lib/llvm-*/bin/clang-offload-bundler"),
                                     reverse=True)), None)


def bundler_targets(shared, tool):
    """What clang-offload-bundler --list says the .hip_fatbin of the library
    holds, bundle by bundle (it lists one bundle per input), host entries left out."""
    offset, size = shared.sections[".hip_fatbin"]
    section = shared.data[offset:offset + size]
    starts = [m.start() for m in re.finditer(re.escape(check_contract.BUNDLE_MAGIC), section)]
    targets = set()
    with tempfile.TemporaryDirectory(prefix="check-contract-bundles-") as scratch:
        for index, start in enumerate(starts):
            path = os.path.join(scratch, "%d.bundle" % index)
            with open(path, "wb") as handle:
                handle.write(section[start:(starts[index + 1:] or [len(section)])[0]])
            listed = subprocess.run([tool, "--list", "--type=o", "--input=" + path],
                                    stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                    universal_newlines=True, check=True).stdout
            targets.update(line.split("--", 1)[1] for line in listed.split()
                           if not line.startswith("host-"))
    return targets


class HipBundleReaderTest(unittest.TestCase):
    """The offload bundle reader on bundles written here: no compiler needed."""

    def test_several_bundles_with_features_are_read(self):
        library = hip_fatbin_library(hip_fatbin(hip_bundle("gfx90a:xnack+", "gfx1030"),
                                                hip_bundle("gfx940:sramecc+:xnack-", "gfx1030")))
        self.assertEqual(check_contract.hip_targets(library),
                         {"gfx90a:xnack+", "gfx1030", "gfx940:sramecc+:xnack-"})

    def test_old_rocm_ids_and_generic_targets_are_read(self):
        library = hip_fatbin_library(offload_bundle([
            ("hip-amdgcn-amd-amdhsa-gfx906", b"x"), ("hipv4-amdgcn-amd-amdhsa--gfx11-generic", b"y"),
            ("host-x86_64-unknown-linux-gnu", b"")]))
        self.assertEqual(check_contract.hip_targets(library), {"gfx906", "gfx11-generic"})

    def test_a_zlib_compressed_bundle_is_read_in_every_header_version(self):
        for version in (1, 2, 3):
            with self.subTest(version=version):
                compressed = compressed_bundle(hip_bundle("gfx90a", "gfx1030"),
                                               check_contract.COMPRESSION_ZLIB, version)
                library = hip_fatbin_library(hip_fatbin(compressed, hip_bundle("gfx940")))
                self.assertEqual(check_contract.hip_targets(library), {"gfx90a", "gfx1030", "gfx940"})

    @unittest.skipUnless(shutil.which("zstd"), "zstd is not installed, so the zstd frame written "
                         "here cannot be checked against a real decoder")
    def test_the_zstd_frame_written_here_is_real(self):
        bundle = hip_bundle("gfx90a")
        frame = compressed_bundle(bundle, check_contract.COMPRESSION_ZSTD)[4 + 4 + 8 + 8:]
        done = subprocess.run(["zstd", "-d", "-c"], input=frame, stdout=subprocess.PIPE, check=True)
        self.assertEqual(done.stdout, bundle)

    def test_a_zstd_compressed_bundle_cannot_be_verified(self):
        library = hip_fatbin_library(hip_fatbin(
            hip_bundle("gfx90a"),
            compressed_bundle(hip_bundle("gfx1030"), check_contract.COMPRESSION_ZSTD)))
        with self.assertRaises(check_contract.BinaryError) as raised:
            check_contract.hip_targets(library)
        self.assertEqual(str(raised.exception), "its offload bundle is compressed with zstd, which "
                         "Python's standard library cannot read")

    def test_damaged_bundles_cannot_be_verified(self):
        bundle = hip_bundle("gfx90a")
        zlib_bundle = compressed_bundle(bundle, check_contract.COMPRESSION_ZLIB)
        for section, message in (
                (bundle[:-10], "a truncated offload bundle at offset 14"),
                (bundle + b"\0" * 7 + b"junk", "no offload bundle at offset %d, in its .hip_fatbin"
                 % (14 + len(bundle) + 7)),
                (zlib_bundle[:-6], "the zlib-compressed offload bundle at offset 14 does not "
                 "decompress to a bundle"),
                (zlib_bundle[:4] + b"\x09\x00" + zlib_bundle[6:],
                 "a compressed offload bundle of version 9, which this checker cannot read"),
                (zlib_bundle[:6] + b"\x07\x00" + zlib_bundle[8:],
                 "its offload bundle is compressed by method 7, which this checker does not know")):
            with self.subTest(message=message):
                with self.assertRaises(check_contract.BinaryError) as raised:
                    check_contract.hip_targets(hip_fatbin_library(section))
                self.assertEqual(str(raised.exception), message)

    def test_a_library_without_section_headers_cannot_be_verified(self):
        library = check_contract.SharedObject(hip_bundle("gfx90a"), {}, set())
        with self.assertRaises(check_contract.BinaryError) as raised:
            check_contract.hip_targets(library)
        self.assertEqual(str(raised.exception), "it has no section headers, so its .hip_fatbin "
                         "cannot be found")

    def test_a_library_without_hip_code_holds_no_target(self):
        library = check_contract.SharedObject(b"\x7fELF", {".text": (0, 4)}, set())
        self.assertEqual(check_contract.hip_targets(library), set())

    def test_the_bundles_written_here_are_what_clang_offload_bundler_lists(self):
        tool = clang_offload_bundler()
        if tool is None:
            self.skipTest("clang-offload-bundler is not installed (it comes with hipcc's clang)")
        library = hip_fatbin_library(hip_fatbin(hip_bundle("gfx90a:xnack+", "gfx1030"),
                                                hip_bundle("gfx940:sramecc-:xnack-")))
        self.assertEqual(bundler_targets(library, tool), check_contract.hip_targets(library))

    def test_a_library_whose_bundles_cannot_be_read_passes_with_a_warning_that_says_so(self):
        # The library is a C one holding the section, built by a stand-in for
        # hipcc that drops the target flags and runs cc: no HIP compiler needed.
        if not shutil.which("cc"):
            self.skipTest("cc is not installed")
        section = hip_fatbin(hip_bundle("gfx90a"),
                             compressed_bundle(hip_bundle("gfx90a"), check_contract.COMPRESSION_ZSTD))
        root = tempfile.mkdtemp(prefix="check-contract-")
        self.addCleanup(shutil.rmtree, root, True)
        write_tree(root, {
            "backends/hip/zs/zs.backend.json": {
                "name": "zs", "abi_version": 1, "status": "experimental", "sources": ["zs.c"],
                "build": {"script": "build.sh", "output": "libzs.so", "architectures": ["gfx90a"]}},
            "backends/hip/zs/zs.c": (
                "#define ZS_ABI_VERSION 1\nunsigned zs_abi_version(void) { return ZS_ABI_VERSION; }\n"
                "const char* zs_error_string(int code) { return \"ok\"; }\n"
                "__attribute__((section(\".hip_fatbin\"), aligned(4096), used)) const unsigned char "
                "zs_fatbin[] = {%s};\n" % ",".join(str(b) for b in section)),
            "backends/hip/zs/build.sh": Executable(
                '#!/bin/sh\nmkdir -p "$1"\n'
                '"${HIPCC:-hipcc}" -shared -fPIC --offload-arch=gfx90a -o "$1/libzs.so" '
                '"$(dirname "$0")/zs.c"\n'),
            "cc-for-hipcc": Executable('#!/bin/sh\nfor a; do shift; case $a in --offload-arch=*) ;; '
                                       '*) set -- "$@" "$a" ;; esac; done\nexec cc "$@"\n')})
        rc, out, err = run_main(["--repo-root", root, "build", "--out", os.path.join(root, "out")],
                                env={"HIPCC": os.path.join(root, "cc-for-hipcc")})
        self.assertEqual((rc, err), (0, ""), out)
        self.assertIn("\nbackends/hip/zs/build.sh: [warning] R011 hip/zs: cannot verify the gfx "
                      "targets of libzs.so: its offload bundle is compressed with zstd, which "
                      "Python's standard library cannot read\n", out)
        self.assertRegex(out, r"\npassed hip/zs: exports zs_abi_version and zs_error_string; "
                              r"zs_abi_version\(\) = 1; gfx targets not verified \(")


HIPCC = shutil.which("hipcc")

TINY_HIP = """#include <cstdint>
#include <hip/hip_runtime.h>
#define GPUTINY_ABI_VERSION 1
#define GPUTINY_API extern "C" __attribute__((visibility("default")))
GPUTINY_API uint32_t gputiny_abi_version(void) { return GPUTINY_ABI_VERSION; }
GPUTINY_API const char* gputiny_error_string(int code) { return code ? "bad argument" : "ok"; }
namespace {
__global__ void zero(float* x) { x[threadIdx.x] = 0.0f; }
}
GPUTINY_API int gputiny_zero(float* x, hipStream_t stream) {
    hipLaunchKernelGGL(zero, dim3(1), dim3(32), 0, stream, x);
    return hipGetLastError() == hipSuccess ? 0 : 1000;
}
"""

TWICE_HIP = """#include <hip/hip_runtime.h>
namespace {
__global__ void twice(float* x, int n) { int i = threadIdx.x; if (i < n) x[i] *= 2.0f; }
}
extern "C" __attribute__((visibility("default"))) int gputiny_twice(float* x, int n, hipStream_t stream) {
    hipLaunchKernelGGL(twice, dim3(1), dim3(32), 0, stream, x, n);
    return hipGetLastError() == hipSuccess ? 0 : 1000;
}
"""

HIP_BUILD = Executable("""#!/bin/bash
set -euo pipefail
if [ $# -ge 2 ]; then
  targets=(--offload-arch="$2")
else
  targets=(--offload-arch=gfx90a:xnack+ --offload-arch=gfx1030)
fi
mkdir -p "$1"
cd "$(dirname "$0")"
HIP_PLATFORM=amd "${HIPCC:-hipcc}" -fPIC -shared -fvisibility=hidden "${targets[@]}" \\
    tiny.hip twice.hip -o "$1/libgputiny.so"
""")


@unittest.skipUnless(HIPCC, "hipcc is not installed (apt-get install --no-install-recommends "
                     "hipcc), so no HIP fixture can be built")
class HipBuildTierTest(TreeTest):
    """The build tier on a real hipcc build (no GPU needed): the gfx targets
    in the library's offload bundles against the manifest."""

    def setUp(self):
        super().setUp()
        self.tree({
            "backends/hip/gputiny/gputiny.backend.json": {
                "name": "gputiny", "abi_version": 1, "status": "experimental",
                "sources": ["tiny.hip", "twice.hip"],
                "build": {"script": "build.sh", "output": "libgputiny.so",
                          "architectures": ["gfx90a:xnack+", "gfx1030"]}},
            "backends/hip/gputiny/tiny.hip": TINY_HIP,
            "backends/hip/gputiny/twice.hip": TWICE_HIP,
            "backends/hip/gputiny/build.sh": HIP_BUILD})

    def build(self, *args, env=None):
        """Run the build tier; where clang-offload-bundler is installed, every
        library built is also read by it, and the two readers must agree."""
        # hipcc (clang's driver) leaves an empty folder in $TMPDIR per compile:
        # give it this test's.
        scratch = self.path("hipcc-tmp")
        os.makedirs(scratch, exist_ok=True)
        result = run_main(["--repo-root", self.root, "build", "--out", self.path("out")] + list(args),
                          env=dict(env or {}, TMPDIR=scratch))
        tool = clang_offload_bundler()
        if tool is not None and os.path.isfile(self.path("out/hip/gputiny/libgputiny.so")):
            library = self.library()
            self.assertEqual(bundler_targets(library, tool), check_contract.hip_targets(library))
        return result

    def library(self):
        return check_contract.read_shared_object(self.path("out/hip/gputiny/libgputiny.so"))

    def test_targets_with_features_match_the_manifest_and_are_named(self):
        rc, out, err = self.build()
        self.assertEqual((rc, err), (0, ""), out)
        self.assertRegex(out, r"\npassed hip/gputiny: exports gputiny_abi_version and "
                              r"gputiny_error_string; gputiny_abi_version\(\) = 1; "
                              r"gfx targets gfx1030, gfx90a:xnack\+ \(")

    def test_a_single_target_build_is_held_to_its_arch(self):
        rc, out, err = self.build("--arch", "gfx940")
        self.assertEqual((rc, err), (0, ""), out)
        self.assertRegex(out, r"\npassed hip/gputiny: .*; gfx targets gfx940 \(")

    def test_a_compiler_that_adds_a_target_is_an_error_naming_it(self):
        wrapper = self.path("hipcc-plus-gfx940")
        with open(wrapper, "w") as handle:
            handle.write('#!/bin/sh\nexec "%s" "$@" --offload-arch=gfx940\n' % HIPCC)
        os.chmod(wrapper, 0o755)
        rc, out, err = self.build(env={"HIPCC": wrapper})
        self.assertEqual(rc, 1, out)
        self.assertIn("\nbackends/hip/gputiny/build.sh: [error] R008 hip/gputiny: the offload "
                      "bundles of libgputiny.so hold code objects for gfx1030, gfx90a:xnack+, "
                      "gfx940 but build.architectures is gfx1030, gfx90a:xnack+\n", out)

    def test_a_manifest_target_the_library_lacks_is_an_error_naming_it(self):
        # The script's reader would see the drift too (B006): here the script
        # reads its targets from a file, so only the library can tell.
        self.tree({"backends/hip/gputiny/build.sh": Executable(str(HIP_BUILD).replace(
            "targets=(--offload-arch=gfx90a:xnack+ --offload-arch=gfx1030)",
            'mapfile -t targets < "$(dirname "$0")/targets.txt"')),
            "backends/hip/gputiny/targets.txt": "--offload-arch=gfx90a:xnack+\n",
            "backends/hip/gputiny/gputiny.backend.json": {
                "name": "gputiny", "abi_version": 1, "status": "experimental",
                "sources": ["tiny.hip", "twice.hip"],
                "build": {"script": "build.sh", "output": "libgputiny.so",
                          "architectures": ["gfx90a:xnack+", "gfx1030"]},
                "ignore": {"B017": "the targets come from targets.txt"}}})
        rc, out, err = self.build()
        self.assertEqual(rc, 1, out)
        self.assertIn("\nbackends/hip/gputiny/build.sh: [error] R008 hip/gputiny: the offload "
                      "bundles of libgputiny.so hold code objects for gfx90a:xnack+ but "
                      "build.architectures is gfx1030, gfx90a:xnack+\n", out)

    def test_a_kernel_with_external_linkage_is_exported_despite_hidden_visibility(self):
        self.tree({"backends/hip/gputiny/twice.hip": TWICE_HIP.replace("namespace {\n", "").replace(
            "}\nextern", "extern")})
        rc, out, err = self.build("--format", "json")
        self.assertEqual(rc, 1, out)
        self.assertEqual([(i["code"], i["message"]) for i in json.loads(out)["results"][0]["issues"]], [
            ("R010", "libgputiny.so exports 1 name(s) without the prefix gputiny_ (_Z5twicePfi), "
             "which the C ABI gives every name; hide them (put each __global__ kernel in an "
             "anonymous namespace or make it static; -fvisibility=hidden does not hide a kernel's "
             "handle under hipcc)")])

    def test_the_reader_agrees_with_clang_offload_bundler(self):
        tool = clang_offload_bundler()
        if tool is None:
            self.skipTest("clang-offload-bundler is not installed (it comes with hipcc's clang)")
        rc, out, err = self.build("--arch", "gfx940:sramecc+:xnack-")
        self.assertEqual(rc, 0, out)
        library = self.library()
        self.assertEqual(bundler_targets(library, tool), {"gfx940:sramecc+:xnack-"})
        self.assertEqual(len(re.findall(re.escape(check_contract.BUNDLE_MAGIC), library.data)),
                         2)  # one bundle per source

    def test_hipcc_compile_flags_append_adds_its_targets_to_build_and_trace_alike(self):
        targets = ["gfx90a:xnack+", "gfx1030", "gfx906"]
        self.tree({"backends/hip/gputiny/build.sh": Executable(
            HIP_BUILD.replace('mkdir -p "$1"', 'mkdir -p "$1"\n'
                              'export HIPCC_COMPILE_FLAGS_APPEND=--offload-arch=gfx906')),
            "backends/hip/gputiny/gputiny.backend.json": {
                "name": "gputiny", "abi_version": 1, "status": "experimental",
                "sources": ["tiny.hip", "twice.hip"],
                "build": {"script": "build.sh", "output": "libgputiny.so", "architectures": targets}}})
        rc, out, err = self.build()
        self.assertEqual((rc, check_contract.hip_targets(self.library())), (0, set(targets)), out)
        rc, out, err = run_main(["--repo-root", self.root, "trace", "--format", "json"])
        (result,) = json.loads(out)["results"]
        self.assertEqual(sorted(result["runs"][0]["targets"]), sorted(targets))
        self.assertEqual([i for i in result["issues"] if "<output-dir> shows" in i["message"]], [])


def tree_digest(root):
    """Every path under root with its type, mode and content (or link target)."""
    digest = {}
    for top, dirs, files in os.walk(root):
        for name in dirs + files:
            path = os.path.join(top, name)
            info = os.lstat(path)
            if os.path.islink(path):
                digest[path] = ("link", os.readlink(path))
            elif os.path.isdir(path):
                digest[path] = ("dir", info.st_mode)
            else:
                with open(path, "rb") as handle:
                    digest[path] = ("file", info.st_mode, handle.read())
    return digest


def survivors(marker, wait=10):
    """The pids of live processes whose command line holds marker, once
    they are gone or wait seconds have passed."""
    deadline = time.monotonic() + wait
    while True:
        found = []
        for entry in filter(str.isdigit, os.listdir("/proc")):
            try:
                with open("/proc/%s/cmdline" % entry, "rb") as handle:
                    if marker.encode() in handle.read() and not ends(int(entry), 0):
                        found.append(int(entry))
            except OSError:
                pass
        if not found or time.monotonic() > deadline:
            return found
        time.sleep(0.05)


class TraceTierTest(TreeTest):
    def trace(self, *args):
        rc, out, err = run_main(["--repo-root", self.root, "trace", "--format", "json"] + list(args))
        return rc, json.loads(out), err

    def backend(self, script, platform="cuda", output="libk.so", architectures=(80,), **extra):
        files = {
            "backends/%s/k/k.backend.json" % platform: {
                "name": "k", "abi_version": 1, "status": "experimental", "sources": ["k.cu"],
                "build": {"script": "build.sh", "output": output,
                          "architectures": list(architectures)}},
            "backends/%s/k/k.cu" % platform: "#define K_ABI_VERSION 1\n",
            "backends/%s/k/build.sh" % platform: Executable(script)}
        files.update(extra)
        self.tree(files)

    def test_fat_and_single_target_runs_report_calls_output_and_targets(self):
        self.tree(fat_files())
        rc, report, err = self.trace()
        self.assertEqual(rc, 0, report)
        (result,) = report["results"]
        self.assertEqual((result["result"], result["issues"]), ("passed", []))
        default, single = result["runs"]
        self.assertEqual(default["command"], "./backends/cuda/fat/build.sh <output-dir>")
        self.assertEqual(single["command"], "./backends/cuda/fat/build.sh <output-dir> 90")
        self.assertEqual((default["output"], default["landed"], default["targets"]),
                         ("<output-dir>/libfat.so", "libfat.so", ["80", "89", "90"]))
        self.assertEqual((single["landed"], single["targets"]), ("libfat.so", ["90"]))
        (call,) = default["calls"]
        self.assertEqual(call["cwd"], ".")
        self.assertEqual(call["words"][:4], ["nvcc", "-O3", "-shared", "-Xcompiler"])
        self.assertIn("arch=compute_90,code=[sm_90,compute_90]", call["words"])
        self.assertEqual(default["written"], ["libfat.so"])

    def test_text_report_lists_each_run_and_its_calls(self):
        self.tree(fat_files())
        rc, out, err = run_main(["--repo-root", self.root, "trace", "fat", "--arch", "89"])
        self.assertEqual(rc, 0, out)
        self.assertIn("==> trace cuda/fat: ./backends/cuda/fat/build.sh <output-dir> 89\n", out)
        self.assertIn("\n  ./backends/cuda/fat/build.sh <output-dir> 89\n    nvcc -O3 -shared "
                      "-Xcompiler -fPIC -gencode arch=compute_89,code=sm_89 -o "
                      "<output-dir>/libfat.so ops.cu  (in .)\n    -> 1 compiler call(s); writes "
                      "<output-dir>/libfat.so; targets 89\n", out)
        self.assertTrue(out.endswith("\n1 backend(s) passed, 0 failed, 0 skipped\n"), out)

    def test_a_library_written_beside_the_output_directory_is_named_so(self):
        # Outside <output-dir> but inside the trace's temporary directory: named from
        # <output-dir>, the one place of it the user knows.
        self.backend('#!/usr/bin/env bash\nmkdir -p "$1" "$1/../../x64"\n'
                     'nvcc -arch=sm_80 -shared -o "$1/../../x64/libk.so" k.cu\n')
        rc, report, err = self.trace()
        (result,) = report["results"]
        self.assertEqual(rc, 1)
        self.assertIn(("B013", "running build.sh <output-dir> shows: build script build.sh writes "
                       "its library to <output-dir>/../../x64/libk.so, not under its <output-dir> "
                       "argument ($1): the build tier and CI look for libk.so in <output-dir>; "
                       "write -o \"$1/libk.so\""),
                      [(i["code"], i["message"]) for i in result["issues"]])

    def test_a_temporary_path_inside_a_word_is_shown_as_what_it_stands_for(self):
        self.backend('#!/usr/bin/env bash\nmkdir -p "$1"\n'
                     'nvcc -arch=$1 -I$1/inc -shared -o "$1/libk.so" k.cu\n')
        rc, report, err = self.trace()
        (result,) = report["results"]
        self.assertEqual(result["runs"][0]["calls"][0]["words"][:3],
                         ["nvcc", "-arch=<output-dir>", "-I<output-dir>/inc"])

    def test_a_command_the_machine_does_not_have_is_named(self):
        self.backend('#!/usr/bin/env bash\nset -e\nmkdir -p "$1"\ncheck-contract-no-such-tool\n'
                     'nvcc -arch=sm_80 -shared -o "$1/libk.so" k.cu\n')
        rc, report, err = self.trace()
        (result,) = report["results"]
        self.assertEqual((rc, [(i["code"], i["message"]) for i in result["issues"]]), (1, [
            ("R001", "running build.sh <output-dir>%s shows: the script failed with exit status "
             "127: it runs check-contract-no-such-tool, which is not on its PATH" % arch)
            for arch in (" 80", "")]))

    def test_the_compiler_picked_from_cuda_home_or_path_is_traced(self):
        # The shape the script reader misread (B005): assignments after then/else.
        self.backend('#!/usr/bin/env bash\nset -euo pipefail\nout=$1\nmkdir -p "$out"\n'
                     'nvcc=${NVCC:-}\n'
                     'if [ -z "$nvcc" ]; then\n'
                     '    if [ -n "${CUDA_HOME:-}" ]; then nvcc=$CUDA_HOME/bin/nvcc; '
                     'else nvcc=$(command -v nvcc); fi\nfi\narch=89\n'
                     '"$nvcc" -O3 -gencode "arch=compute_${arch},code=[sm_${arch},compute_${arch}]"'
                     ' -shared -o "$out/libk.so" k.cu\n', architectures=[89])
        rc, report, err = self.trace()
        (result,) = report["results"]
        self.assertEqual((rc, result["issues"]), (0, []), report)
        self.assertEqual(result["runs"][0]["calls"][0]["words"][:2], ["nvcc", "-O3"])

    def test_versioned_and_wrapped_compilers_and_probes_are_shimmed(self):
        self.backend('#!/usr/bin/env bash\nset -euo pipefail\nmkdir -p "$1"\n'
                     'release=$(nvcc --version | sed -n "s/.*release \\([0-9.]*\\),.*/\\1/p")\n'
                     '[ -n "$release" ] || { echo "no nvcc release" >&2; exit 1; }\n'
                     'gcc-12 -dumpversion >/dev/null\n'
                     'echo "int main(void){return 0;}" | cc -x c -o /dev/null -\n'
                     'CCACHE_DISABLE=1 ccache clang++-18 -c k.cpp -o "$1/k.o"\n'
                     'sccache g++ -c k.cpp -o "$1/k2.o"\n'
                     '"$CXX" -c k.cpp -o"$1/k3.o"\n'
                     '"$ROCM_PATH/llvm/bin/clang++" -c k.cpp -o "$1/k4.o"\n'
                     'mkdir -p dir\n"$CUDA_HOME/bin/nvcc" -arch=sm_80 -c -odir "$1" k.cu  # not -o dir\n'
                     '"$CUDA_HOME/bin/nvcc" -arch=sm_80 -shared --output-file="$1/libk.so" "$1"/k*.o\n')
        rc, report, err = self.trace()
        (result,) = report["results"]
        self.assertEqual((rc, result["issues"]), (0, []), report)
        calls = result["runs"][0]["calls"]
        self.assertEqual([(c["via"], c["words"][0]) for c in calls],
                         [(None, "nvcc"), (None, "gcc-12"), (None, "cc"), ("ccache", "clang++-18"),
                          ("sccache", "g++"), (None, "c++"), (None, "clang++"), (None, "nvcc"),
                          (None, "nvcc")])
        self.assertEqual(result["runs"][0]["written"], ["k.o", "k2.o", "k3.o", "k4.o", "libk.so"])
        self.assertEqual([c["outputs"] for c in calls[-2:]], [[], ["<output-dir>/libk.so"]])

    def test_a_compiler_run_by_its_path_is_named(self):
        gcc = "/usr/bin/gcc"
        if not os.access(gcc, os.X_OK):
            self.skipTest("%s is not installed" % gcc)
        self.backend('#!/usr/bin/env bash\nset -eu\nmkdir -p "$1"\n'
                     'echo "int k_abi_version(void){return 1;}" > "$1/k.c"\n'
                     '%s -shared -fPIC -march=x86-64 -o "$1/libk.so" "$1/k.c"\n' % gcc,
                     platform="cpu", architectures=["x86-64"])
        rc, report, err = self.trace()
        (result,) = report["results"]
        self.assertEqual(rc, 1, report)
        messages = [(i["level"], i["code"], i["message"]) for i in result["issues"]]
        self.assertIn(("warning", "X001", "running build.sh <output-dir> shows: the script runs the compiler /usr/bin/gcc by its path, which the trace cannot "
                       "intercept; what that call built is not in this report (call it by name, or "
                       "through $NVCC/$CC/$CXX/$HIPCC or CUDA_HOME/ROCM_PATH)"), messages)
        self.assertIn(("error", "B005", "running build.sh <output-dir> shows: build script "
                       "build.sh has no compiler command with -o; the script must write "
                       "build.output into its <output-dir> argument"), messages)

    def test_a_binary_no_shim_wrote_is_named(self):
        # sh and make run no BASH_ENV: a compiler called by its path there is found by what
        # it leaves, a compiled file, where a shim leaves an empty one.
        gcc = "/usr/bin/gcc"
        if not os.access(gcc, os.X_OK):
            self.skipTest("%s is not installed" % gcc)
        self.backend('#!/bin/sh\nset -e\nmkdir -p "$1"\n'
                     'echo "int k(void){return 1;}" > "$1/k.c"\n'
                     '%s -c -o "$1/k.o" "$1/k.c"\n'
                     'cc -march=x86-64 -shared -o "$1/libk.so" "$1/k.o"\n' % gcc,
                     platform="cpu", architectures=["x86-64"])
        rc, report, err = self.trace()
        (result,) = report["results"]
        self.assertEqual(rc, 0, report)
        self.assertIn((
            "X001", "running build.sh <output-dir> shows: the script leaves <output-dir>/k.o, a "
            "compiled file no shim wrote: a compiler the trace cannot intercept made it (one run "
            "by its path, from make or sh?); what that call built is not in this report"),
            [(i["code"], i["message"]) for i in result["issues"]])

    def test_single_target_run_that_ignores_its_target_is_reported(self):
        self.tree(fat_files())
        self.tree({"backends/cuda/fat/build.sh": Executable(
            CUDA_FAT_BUILD.replace('"arch=compute_$2,code=sm_$2"', "arch=compute_80,code=sm_80"))})
        rc, report, err = self.trace("--arch", "89")
        (result,) = report["results"]
        self.assertEqual(rc, 1)
        self.assertEqual([(i["level"], i["code"], i["message"]) for i in result["issues"]], [
            ("error", "B006", "running build.sh <output-dir> 89 shows: the single-target "
             "invocation does not build 89"),
            ("error", "B007", "running build.sh <output-dir> 89 shows: the single-target "
             "invocation for 89 also builds 80")])

    def test_the_repository_stays_byte_identical(self):
        subprocess.run(["git", "init", "-q", self.root], check=True)
        self.backend('#!/usr/bin/env bash\nset -eu\nhere=$(cd "$(dirname "$0")" && pwd)\n'
                     'echo stamp > "$here/stamp"\necho "// changed" >> "$here/k.cu"\n'
                     'rm -f "$here/k.backend.json"\nchmod 600 "$here/build.sh"\n'
                     'echo x > "$here/linked/through"\nmkdir -p "$1"\nmkdir -p "$here/../../../build"\n'
                     'echo y > "$here/../../../build/lib.so"\ntouch "$HOME/.cache"\n'
                     'nvcc -arch=sm_80 -shared -o "$1/libk.so" k.cu\n',
                     **{"backends/cuda/k/data/keep": "kept\n"})
        os.symlink(self.path("backends/cuda/k/data"), self.path("backends/cuda/k/linked"))
        before = tree_digest(self.root)
        rc, report, err = self.trace()
        (result,) = report["results"]
        self.assertEqual((rc, result["issues"]), (0, []), report)
        self.assertEqual(tree_digest(self.root), before)

    def test_a_failing_script_fails_with_its_status(self):
        self.backend("#!/bin/sh\necho cannot build >&2\nexit 3\n")
        rc, report, err = self.trace()
        (result,) = report["results"]
        self.assertEqual((rc, result["result"]), (1, "failed"))
        self.assertEqual([(i["code"], i["message"]) for i in result["issues"]],
                         [("R001", "running build.sh <output-dir> 80 shows: the script failed "
                           "with exit status 3"),
                          ("R001", "running build.sh <output-dir> shows: the script failed with "
                           "exit status 3")])
        self.assertIn("cannot build\n", err)

    def test_timeout_stops_the_script_and_what_it_started(self):
        # Found by its name: in a PID namespace the script's pids are not the checker's.
        marker = "check-contract-sleep-%d" % os.getpid()
        self.backend('#!/usr/bin/env bash\n(exec -a %s sleep 300) &\nwait\n' % marker)
        rc, report, err = self.trace("--timeout", "1")
        (result,) = report["results"]
        self.assertEqual(rc, 1)
        self.assertEqual((result["issues"][0]["code"], result["issues"][0]["message"]),
                         ("R002", "running build.sh <output-dir> 80 shows: the script did not "
                                  "finish within 1s; it was stopped"))
        self.assertEqual(survivors(marker), [], "the script's background sleep outlived the trace")

    def test_manifest_disagreeing_with_the_trace_is_reported(self):
        self.tree(fat_files(output="libother.so", architectures=[80, 86, 90]))
        rc, report, err = self.trace("fat")
        (result,) = report["results"]
        self.assertEqual(rc, 1)
        found = [(i["level"], i["code"], i["message"]) for i in result["issues"]]
        self.assertEqual(found, [
            ("error", "B004", "running build.sh <output-dir> 90 shows: build script build.sh "
             "writes \"libfat.so\" but build.output is \"libother.so\""),
            ("error", "B004", "running build.sh <output-dir> shows: build script build.sh writes "
             "\"libfat.so\" but build.output is \"libother.so\""),
            ("error", "B006", "running build.sh <output-dir> shows: build.architectures lists 86 "
             "but the default invocation of build.sh does not build it"),
            ("error", "B007", "running build.sh <output-dir> shows: build.sh also builds 89, "
             "which build.architectures does not list; list it (the build tier rejects a library "
             "with targets the manifest does not name, R008)")])

    def test_backend_without_a_build_script_is_skipped(self):
        self.backend("#!/bin/sh\n")
        os.unlink(self.path("backends/cuda/k/build.sh"))
        rc, report, err = self.trace()
        self.assertEqual((rc, report["results"][0]["result"]), (0, "skipped"))
        self.assertEqual(report["results"][0]["detail"], "no build script to trace (build.script "
                         "does not exist); run check_contract.py check cuda/k")


class TraceIsolationTest(TreeTest):
    """Hostile build scripts, traced in namespaces (the first class) and by the
    launcher alone (the second), as the tests' user and as nobody: in
    namespaces what they try fails or is reported, and never reaches the
    host, the checker, the checkout or another backend; without, they reach
    what the isolation line says and no more of the checkout unreported."""

    ENV = {}
    NAMESPACES = True

    @classmethod
    def setUpClass(cls):
        super().setUpClass()
        if cls.NAMESPACES:
            with tempfile.TemporaryDirectory() as top:
                problem = check_contract.namespace_problem(top)
            if problem is not None:
                raise unittest.SkipTest("no namespaces here: %s" % problem)

    def trace(self, *args):
        rc, out, err = run_main(["--repo-root", self.root, "trace", "--format", "json"] + list(args),
                                env=self.ENV)
        return rc, json.loads(out), err

    def backend(self, script, name="k"):
        self.tree({
            "backends/cuda/%s/%s.backend.json" % (name, name): {
                "name": name, "abi_version": 1, "status": "experimental", "sources": ["k.cu"],
                "build": {"script": "build.sh", "output": "lib%s.so" % name, "architectures": [80]}},
            "backends/cuda/%s/k.cu" % name: "#define K_ABI_VERSION 1\n",
            "backends/cuda/%s/build.sh" % name: Executable(
                '#!/usr/bin/env bash\nset -u\nmkdir -p "$1"\nhere=$(cd "$(dirname "$0")" && pwd)\n'
                + script + 'nvcc -arch=sm_80 -shared -o "$1/lib%s.so" "$here/k.cu"\n' % name)})

    def outcomes(self, report):
        return {r["backend"]: (r["result"], [(i["code"], i["message"]) for i in r["issues"]])
                for r in report["results"]}

    def in_both_runs(self, code, message):
        """A finding of the single-target run and of the default one, sorted so."""
        return [(code, "running build.sh <output-dir>%s shows: %s" % (arch, message))
                for arch in (" 80", "")]

    def test_the_isolation_is_named(self):
        self.backend("")
        rc, out, err = run_main(["--repo-root", self.root, "trace"], env=self.ENV)
        self.assertEqual(rc, 0, out)
        line = [l for l in out.splitlines() if l.startswith("isolation: ")]
        self.assertEqual(len(line), 1, out)
        if self.NAMESPACES:
            seen = re.match(r"isolation: namespaces: the script sees, read-only, (.*); writable, "
                            r"the repository's copy and the directory of <output-dir> \(with the "
                            r"run's HOME and TMPDIR\); its own /tmp, /dev \(null, zero, full, "
                            r"random, urandom(?:, tty)?, shm\) and /proc \(its own processes\); "
                            r"nothing else \(not the checkout, your home, /run or the host's "
                            r"/tmp\), no network and, of your environment, only PATH, LANG, "
                            r"LC_ALL, LC_CTYPE, TERM, USER and LOGNAME\Z", line[0])
            self.assertIsNotNone(seen, line[0])
            *read_only, toolkit = seen.group(1).split(", ")
            self.assertEqual((read_only[0], toolkit), ("/usr", "<toolkit>"))
            for path in read_only:  # a system directory, a file of /etc, a directory on PATH
                self.assertTrue(path in check_contract.ISOLATION_SYSTEM or any(
                    fnmatch.fnmatch(path, "/etc/" + p) for p in check_contract.ISOLATION_ETC)
                    or path in os.environ["PATH"].split(os.pathsep), path)
        else:
            self.assertEqual(line[0], "isolation: launcher only, no namespaces "
                             "(CHECK_CONTRACT_NO_NAMESPACES is set): the script runs as you and "
                             "reaches what you can: every file you may read or write (the "
                             "checkout, your home, the host's /tmp), the network, the host's "
                             "sockets and the environment of your other processes, the checker's "
                             "among them; of your environment it starts with only PATH, LANG, "
                             "LC_ALL, LC_CTYPE, TERM, USER and LOGNAME, every process it started "
                             "is killed when it ends, and the checkout is compared with what it "
                             "was")
        rc, report, err = self.trace()
        self.assertEqual(report["isolation"], line[0][len("isolation: "):])

    def tried(self, attempts, env=None):
        """Trace a backend whose script tries each shell command of attempts
        ({name: command}) as each user of users(); {user: the names of the
        commands that succeeded}, every run passed."""
        lines = "".join("if { %s; } >/dev/null 2>&1; then echo 'reached: %s'; fi\n" % (command, name)
                        for name, command in sorted(attempts.items()))
        self.backend(lines)
        os.chmod(self.root, 0o755)  # nobody reads the repository too
        found = {}
        for user, command, user_env in self.users():
            with self.subTest(user=user):
                done = subprocess.run(command + [CHECKER, "--root", self.root, "trace"],
                                      env=dict(user_env, **dict(self.ENV, **(env or {}))),
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                      universal_newlines=True, timeout=120)
                assert_no_temporary_path(done.stdout)
                isolation = [l for l in done.stdout.splitlines() if l.startswith("isolation: ")]
                if self.NAMESPACES and isolation and "no namespaces" in isolation[0]:
                    self.skipTest("%s cannot have namespaces here: %s" % (user, isolation[0]))
                self.assertEqual(done.returncode, 0, done.stdout)
                found[user] = sorted(set(re.findall(r"reached: (\S+)$", done.stdout, re.M)))
        return found

    def users(self):
        """Who the promises are tried as, (name, the command that runs the
        checker's file, its environment): the tests' user; where that is root,
        nobody too, by setpriv, with nobody's home (/nonexistent)."""
        path = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
        yield "the tests' user", [sys.executable], {"PATH": os.environ["PATH"],
                                                    "HOME": os.path.expanduser("~")}
        if os.geteuid() != 0:
            return  # the tests' user is unprivileged already
        python = shutil.which("python3", path=path)
        if shutil.which("setpriv") is None or python is None:
            raise unittest.SkipTest("the tests run as root, and there is no setpriv and python3 "
                                    "in %s to run the checker as nobody" % path)
        yield "nobody", ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", python], {
            "PATH": path, "HOME": "/nonexistent"}

    def test_nothing_the_script_writes_outside_the_copy_survives_in_namespaces(self):
        # A file of its own for each run ($$): nobody cannot replace root's.
        places = {"beside": os.path.join(os.path.dirname(self.root), "check-contract-beside-%d"),
                  "tmp": os.path.join(tempfile.gettempdir(), "check-contract-escaped-%d")}
        if self.NAMESPACES:  # without, a root script could write the tests' checkout and /usr
            places.update(here=os.path.join(HERE, "check-contract-escaped-%d"),
                          usr="/usr/check-contract-escaped-%d")
        places = {name: path % os.getpid() for name, path in places.items()}

        def survived():
            return sorted(name for name, path in places.items() if glob.glob(path + "-*"))
        self.addCleanup(lambda: [os.unlink(f) for p in places.values() for f in glob.glob(p + "-*")])
        found = self.tried({name: 'echo x > "%s-$$"' % path for name, path in places.items()})
        if self.NAMESPACES:
            self.assertEqual(survived(), [])
        else:  # what the isolation line says: it can write what its user can
            self.assertEqual(survived(), ["beside", "tmp"])
            self.assertEqual(found, {u: ["beside", "tmp"] for u in found})

    def test_host_sockets_cannot_be_reached_in_namespaces(self):
        host = tempfile.mkdtemp(prefix="check-contract-host-")
        self.addCleanup(shutil.rmtree, host, True)
        os.chmod(host, 0o777)
        listening = []
        for name, address in (("path", os.path.join(host, "daemon.sock")),
                              ("abstract", "\0check-contract-%d" % os.getpid())):
            server = socket.socket(socket.AF_UNIX)
            self.addCleanup(server.close)
            server.bind(address)
            if name == "path":
                os.chmod(address, 0o777)
            server.listen(8)
            server.setblocking(False)
            listening.append((name, server))
        connect = ("python3 -c 'import socket, sys; s = socket.socket(socket.AF_UNIX); "
                   "s.connect(sys.argv[1].replace(\"@\", chr(0), 1)); s.sendall(b\"x\")' %s")
        found = self.tried({"path": connect % os.path.join(host, "daemon.sock"),
                            "abstract": connect % ("@check-contract-%d" % os.getpid())})
        accepted = []
        for name, server in listening:
            while True:
                try:
                    server.accept()[0].close()
                except BlockingIOError:
                    break
                accepted.append(name)
        runs = 2 * len(found)  # the default and the single-target run, as each user
        if self.NAMESPACES:
            self.assertEqual((accepted, found), ([], {u: [] for u in found}))
        else:  # what the isolation line says: it reaches the host's sockets
            self.assertEqual(sorted(accepted), ["abstract"] * runs + ["path"] * runs)

    def test_the_caller_and_the_host_are_not_visible_in_namespaces(self):
        attempts = {"run": "ls /run", "var-run": "ls /var/run", "home": "ls %s" % os.path.expanduser("~"),
                    "checkout": "ls %s" % self.root, "proc": "kill -0 %d" % os.getpid()}
        found = self.tried(attempts)
        for user, reached in found.items():
            if self.NAMESPACES:
                self.assertEqual(reached, [], user)
            else:
                self.assertIn("run", reached, user)

    def test_the_scripts_environment_holds_nothing_of_the_callers(self):
        found = self.tried({"secret": 'env | grep -q CHECK_CONTRACT_SECRET',
                            "home": '[ "$HOME" = %s ]' % os.path.expanduser("~")},
                           env={"CHECK_CONTRACT_SECRET": "token"})
        self.assertEqual(found, {u: [] for u in found})

    def test_a_home_that_does_not_exist_or_cannot_be_read_is_not_shown(self):
        # Debian's nobody has /nonexistent; /root is a home only root may read.
        for home in ("/nonexistent", "/root"):
            found = self.tried({"home": "ls %s" % home}, env={"HOME": home})
            if self.NAMESPACES:
                self.assertEqual(found, {u: [] for u in found}, home)

    def test_the_threat_model_says_what_the_isolation_line_says(self):
        with open(os.path.join(HERE, "docs", "check_contract.md"), encoding="utf-8") as f:
            text = f.read()
        model = " ".join(text[text.index("### Threat model"):text.index("| Option |", text.index(
            "### Threat model"))].replace("`", "").split())
        for name in (check_contract.ISOLATION_SYSTEM + check_contract.ISOLATION_ETC
                     + check_contract.ISOLATION_DEVICES + check_contract.TRACE_KEPT_VARIABLES):
            self.assertIn(name, model)
        self.assertIn("**Without namespaces** " + check_contract.UNISOLATED + ".", model)
        for words in ("its own /tmp, its own /dev", "only the repository's copy and the directory "
                      "of <output-dir> (with the run's HOME and TMPDIR)",
                      "not the checkout, your home", "/run, /var/run or the host's /tmp"):
            self.assertIn(words, model)

    def test_the_script_cannot_read_the_checkers_environment(self):
        self.backend('parent=no any=no\n'
                     'tr "\\0" "\\n" < /proc/$PPID/environ | grep -q CHECK_CONTRACT_SECRET && parent=yes\n'
                     'for f in /proc/[0-9]*/environ; do\n'
                     '  tr "\\0" "\\n" < "$f" 2>/dev/null | grep -q CHECK_CONTRACT_SECRET && any=yes\n'
                     'done\necho "parent=$parent any=$any"\n')
        # A process of its own: the checker's environment as it was started.
        env = dict(os.environ, CHECK_CONTRACT_SECRET="token", **self.ENV)
        done = subprocess.run([sys.executable, CHECKER, "--root", self.root, "trace"], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              universal_newlines=True, timeout=120)
        assert_no_temporary_path(done.stdout)
        self.assertEqual(done.returncode, 0, done.stdout)
        # Without namespaces the launcher's environment is empty, but a process of the
        # same user can still read the checker's: the threat model says so.
        self.assertIn("parent=no any=%s\n" % ("no" if self.NAMESPACES else "yes"), done.stdout)

    def test_writing_the_checkout_fails_or_is_an_error_and_other_backends_never_see_it(self):
        self.backend('echo hacked > %s 2>/dev/null\necho x > %s 2>/dev/null\n'
                     % (self.path("backends/cuda/a/k.cu"), self.path("stamp")), name="a")
        self.backend('if grep -q hacked "$here/../a/k.cu"; then echo "a copy of a changed '
                     'checkout"; exit 1; fi\n', name="b")
        rc, report, err = self.trace()
        found = self.outcomes(report)
        self.assertEqual(found["cuda/b"], ("passed", []), err)
        if self.NAMESPACES:
            self.assertEqual((rc, found["cuda/a"]), (0, ("passed", [])))
            self.assertFalse(os.path.exists(self.path("stamp")))
        else:
            self.assertEqual(rc, 1)
            self.assertEqual(found["cuda/a"], ("failed", self.in_both_runs(
                "X002", "the script changed the checkout: backends/cuda/a/k.cu, stamp; a build "
                "script must write only into its <output-dir> argument and temporary files")))

    def test_a_hard_link_to_a_checkout_file_is_no_change_of_it(self):
        # A link made or removed elsewhere changes a file's link count and change
        # time, not its bytes: a local `git clone` shares the objects of .git so.
        elsewhere = tempfile.mkdtemp(prefix="check-contract-links-")
        self.addCleanup(check_contract.remove_tree, elsewhere)
        self.backend("ln %s %s/link 2>/dev/null\n" % (self.path("backends/cuda/k/k.cu"), elsewhere))
        rc, report, err = self.trace()
        self.assertEqual((rc, self.outcomes(report)), (0, {"cuda/k": ("passed", [])}), err)
        self.assertEqual(os.path.exists(os.path.join(elsewhere, "link")), not self.NAMESPACES)

    def test_a_change_to_the_checkout_while_the_script_runs_is_its_only_where_it_can_reach_it(self):
        # Another process edits the checkout during the first run.  In namespaces the
        # script cannot see the checkout, so the change is not the script's.  The
        # script and the test meet in the script's copy, in the checker's TMPDIR.
        tmp = tempfile.mkdtemp(prefix="check-contract-shared-")
        self.addCleanup(check_contract.remove_tree, tmp)
        self.tree({"notes.txt": "a\n"})
        self.backend('if [ $# -lt 2 ]; then\n  touch "$here/started"\n'
                     '  while [ ! -e "$here/go" ]; do sleep 0.05; done\nfi\n')
        checker = subprocess.Popen([sys.executable, CHECKER, "--root", self.root, "trace",
                                    "--format", "json"], env=dict(os.environ, TMPDIR=tmp, **self.ENV),
                                   stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                   universal_newlines=True)
        started = os.path.join(tmp, "check-contract-trace-*", "repo", "backends", "cuda", "k",
                               "started")

        def go():
            for path in glob.glob(started):
                open(os.path.join(os.path.dirname(path), "go"), "w").close()
        self.addCleanup(checker.kill)
        self.addCleanup(go)  # first: a script left waiting ends
        deadline = time.monotonic() + 60
        while not glob.glob(started) and time.monotonic() < deadline:
            time.sleep(0.05)
        self.assertTrue(glob.glob(started), "the script never started")
        with open(self.path("notes.txt"), "a") as notes:
            notes.write("b\n")
        go()
        out, err = checker.communicate(timeout=120)
        assert_no_temporary_path(out + err)
        found = self.outcomes(json.loads(out))["cuda/k"]
        if self.NAMESPACES:
            self.assertEqual((checker.returncode, found), (0, ("passed", [])), err)
        else:
            self.assertEqual((checker.returncode, found), (1, ("failed", self.in_both_runs(
                "X002", "the script changed the checkout: notes.txt; a build script must write "
                "only into its <output-dir> argument and temporary files")[1:])), err)

    def test_an_isolation_that_fails_after_the_probe_is_the_checkers_failure(self):
        # A directory on PATH, bound into the script's root, is removed while the
        # first run waits: the second run's root cannot be built.
        if not self.NAMESPACES:
            self.skipTest("without namespaces there is no root to build")
        tmp = tempfile.mkdtemp(prefix="check-contract-shared-")
        self.addCleanup(check_contract.remove_tree, tmp)
        on_path = os.path.join(tmp, "bin")
        os.mkdir(on_path)
        self.backend('if [ $# -lt 2 ]; then\n  touch "$here/started"\n'
                     '  while [ ! -e "$here/go" ]; do sleep 0.05; done\nfi\n')
        checker = subprocess.Popen([sys.executable, CHECKER, "--root", self.root, "trace"],
                                   env=dict(os.environ, PATH=on_path + os.pathsep + os.environ["PATH"],
                                            TMPDIR=tmp, **self.ENV),
                                   stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                   universal_newlines=True)
        started = os.path.join(tmp, "check-contract-trace-*", "repo", "backends", "cuda", "k",
                               "started")

        def go():
            for path in glob.glob(started):
                open(os.path.join(os.path.dirname(path), "go"), "w").close()
        self.addCleanup(checker.kill)
        self.addCleanup(go)
        deadline = time.monotonic() + 60
        while not glob.glob(started) and time.monotonic() < deadline:
            time.sleep(0.05)
        self.assertTrue(glob.glob(started), "the script never started")
        os.rmdir(on_path)
        go()
        out, err = checker.communicate(timeout=120)
        assert_no_temporary_path(out + err)
        self.assertEqual((checker.returncode, err), (3, (
            "check_contract.py: error: X005 the trace's isolation cannot be set up (mount %s: No "
            "such file or directory); the build script was not run: this is the checker's "
            "failure, not the script's; CHECK_CONTRACT_NO_NAMESPACES=1 traces without "
            "namespaces\n" % on_path)), out)

    def test_processes_the_script_sends_off_die_with_it(self):
        marker = "check-contract-orphan-%d" % os.getpid()
        self.backend('setsid bash -c "exec -a %s-setsid sleep 300" >/dev/null 2>&1 </dev/null &\n'
                     'set -m\n(exec -a %s-job sleep 300) &\nset +m\n' % (marker, marker))
        rc, report, err = self.trace()
        self.assertEqual((rc, self.outcomes(report)), (0, {"cuda/k": ("passed", [])}), err)
        self.assertEqual(survivors(marker), [])

    def test_a_shim_rewritten_by_one_backend_reaches_no_other(self):
        self.backend('printf "#!/bin/sh\\nexit 0\\n" > "$(command -v nvcc)" 2>/dev/null\n', name="a")
        self.backend("", name="b")
        rc, report, err = self.trace()
        found = self.outcomes(report)
        self.assertEqual(found["cuda/b"], ("passed", []))
        runs = [r for r in report["results"] if r["backend"] == "cuda/b"][0]["runs"]
        self.assertEqual([len(run["calls"]) for run in runs], [1, 1])
        if self.NAMESPACES or os.geteuid() != 0:  # the shim cannot be written
            self.assertEqual((rc, found["cuda/a"]), (0, ("passed", [])))
        else:
            self.assertEqual((rc, found["cuda/a"]), (1, ("failed", self.in_both_runs(
                "X004", "the script changed the trace's own files: <toolkit>/bin/.shim; what it "
                "built cannot be told"))))

    def test_odd_entries_in_the_call_log_neither_hang_nor_crash_the_checker(self):
        # The shim names its call log on its line record='<log>'/...; no log found, no run.
        self.backend('log=$(sed -n "s/^record=\'\\([^\']*\\)\'.*/\\1/p" "$(command -v nvcc)")\n'
                     '[ -d "$log" ] || exit 9\nmkfifo "$log/1.fifo"\nmkdir "$log/2.dir"\nln -s /dev/zero "$log/3.zero"\n')
        done = subprocess.run([sys.executable, CHECKER, "--root", self.root, "trace", "--format",
                               "json"], env=dict(os.environ, **self.ENV), stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, universal_newlines=True, timeout=60)
        assert_no_temporary_path(done.stdout + done.stderr)
        self.assertEqual(done.returncode, 1, done.stderr)
        self.assertEqual(self.outcomes(json.loads(done.stdout))["cuda/k"], ("failed", self.in_both_runs(
            "X004", "the script changed the trace's own files: the call log's 1.fifo (not a "
            "regular file), the call log's 2.dir (not a regular file), the call log's 3.zero (a "
            "link); what it built cannot be told")))

    def test_an_output_dir_replaced_by_a_link_is_not_followed(self):
        self.backend('mkdir -p "$here/data"\necho secret > "$here/data/secret.txt"\n'
                     'trap \'rm -rf "$1"; ln -s "$here/data" "$1"\' EXIT\n')
        rc, report, err = self.trace()
        (result,) = report["results"]
        self.assertEqual(rc, 1)
        self.assertEqual(result["runs"][0]["written"], [])
        self.assertEqual(self.outcomes(report)["cuda/k"], ("failed", self.in_both_runs(
            "X004", "the script changed the trace's own files: <output-dir> itself (replaced by "
            "a link); what it built cannot be told")))

    def test_control_characters_in_the_scripts_output_are_escaped(self):
        self.backend('printf "x\\r::error file=a::forged\\033[2J\\n"\n')
        rc, out, err = run_main(["--repo-root", self.root, "trace"], env=self.ENV)
        self.assertEqual(rc, 0, out)
        self.assertIn("] x\\r::error file=a::forged\\x1b[2J\n", out)
        self.assertNotIn("\r", out)

    def test_what_a_run_does_to_its_copy_never_reaches_the_next_run(self):
        # Runs that leave their copy as it was share it: a's rewrite of b's
        # source keeps its size, inode and time, and only its change time
        # tells; a's second run and b's runs each find the files as they are
        # in the checkout.
        self.backend('b=$here/../b\n[ ! -e "$b/planted" ] && grep -q "VERSION 1" "$b/k.cu" || exit 5\n'
                     'touch "$b/planted"\nref=$(mktemp)\ntouch -r "$b/k.cu" "$ref"\n'
                     'printf "#define K_ABI_VERSION 9\\n" > "$b/k.cu"\ntouch -r "$ref" "$b/k.cu"\n'
                     'rm "$b/planted"\n', name="a")
        self.backend('[ ! -e "$here/planted" ] && grep -q "VERSION 1" "$here/k.cu" || exit 5\n',
                     name="b")
        rc, report, err = self.trace()
        self.assertEqual(self.outcomes(report), {"cuda/a": ("passed", []), "cuda/b": ("passed", [])})
        self.assertEqual(rc, 0, err)

    def test_directories_a_script_locked_are_removed_without_the_power_to_override_modes(self):
        # chmod 000 on directories of the script's copy, output and home stops
        # a checker that cannot override file modes, as on a CI runner that is
        # not root: where the tests are root, setpriv takes that power away.
        # The next run still gets a copy of its own, and nothing is left.
        without = []
        if os.geteuid() == 0:
            if shutil.which("setpriv") is None:
                self.skipTest("the tests run as root, and there is no setpriv to run without "
                              "CAP_DAC_OVERRIDE")
            without = ["setpriv", "--bounding-set=-dac_override,-dac_read_search,-fowner"]
        self.backend('lock() {\n  mkdir -p "$1/sub" && touch "$1/sub/f" && chmod 000 "$1/sub" "$1"\n}\n'
                     'lock "$1/locked"\nlock "$HOME/locked"\nlock "$here/locked"\n', name="a")
        self.backend('[ ! -e "$here/../a/locked" ] || exit 5\n', name="b")
        scratch = tempfile.mkdtemp(prefix="check-contract-locked-")
        self.addCleanup(check_contract.remove_tree, scratch)
        home, tmp = os.path.join(scratch, "home"), os.path.join(scratch, "tmp")
        os.mkdir(home)
        os.mkdir(tmp)
        env = dict(self.ENV, PATH=os.environ["PATH"], HOME=home, TMPDIR=tmp)
        done = subprocess.run(without + [sys.executable, CHECKER, "--root", self.root, "trace",
                                         "--format", "json"],
                              env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              universal_newlines=True)
        assert_no_temporary_path(done.stdout + done.stderr)
        self.assertEqual(done.returncode, 0, done.stdout + done.stderr)
        self.assertNotIn("Traceback", done.stderr)
        self.assertEqual(self.outcomes(json.loads(done.stdout)),
                         {"cuda/a": ("passed", []), "cuda/b": ("passed", [])})
        self.assertEqual(os.listdir(tmp), [])

    def test_a_link_left_in_place_of_the_copy_is_removed_not_followed(self):
        # When the script ends, its copy is a link to a directory of the
        # checker's user: the next run gets a copy, and the directory and
        # the modes below it are as they were.
        victim = tempfile.mkdtemp(prefix="check-contract-victim-")
        self.addCleanup(check_contract.remove_tree, victim)
        os.mkdir(os.path.join(victim, "kept"), 0o500)
        self.backend('top=$(cd "$here/../../../.." && pwd)\n'
                     'trap \'mv "$top/repo" "$top/moved" && ln -s %s "$top/repo"\' EXIT\n' % victim,
                     name="a")
        self.backend('[ ! -L "$here/../../../../repo" ] || exit 5\n', name="b")
        rc, report, err = self.trace()
        self.assertEqual(self.outcomes(report), {"cuda/a": ("passed", []), "cuda/b": ("passed", [])})
        self.assertEqual(rc, 0, err)
        self.assertEqual(os.listdir(victim), ["kept"])
        self.assertEqual(os.stat(os.path.join(victim, "kept")).st_mode & 0o7777, 0o500)


class TraceLauncherIsolationTest(TraceIsolationTest):
    ENV = {"CHECK_CONTRACT_NO_NAMESPACES": "1"}
    NAMESPACES = False


class TraceLimitsTest(TreeTest):
    """Where a script fails because the shims are no toolkit, trace says it
    cannot tell (X003, a warning), never R001; the shims are as faithful as
    is cheap."""

    def trace(self, *args):
        rc, out, err = run_main(["--repo-root", self.root, "trace", "--format", "json"] + list(args))
        return rc, json.loads(out), err

    def backend(self, script, **extra):
        files = {
            "backends/cuda/k/k.backend.json": {
                "name": "k", "abi_version": 1, "status": "experimental", "sources": ["k.cu"],
                "build": {"script": "build.sh", "output": "libk.so", "architectures": [80]}},
            "backends/cuda/k/k.cu": "#define K_ABI_VERSION 1\n",
            "backends/cuda/k/build.sh": Executable(
                '#!/usr/bin/env bash\nset -eu\nmkdir -p "$1"\ncd "$(dirname "$0")"\n' + script)}
        files.update(extra)
        self.tree(files)

    def assertCannotTell(self, report, why):
        (result,) = report["results"]
        self.assertEqual(result["result"], "passed", result)
        self.assertEqual([(i["level"], i["code"], i["message"]) for i in result["issues"]], [
            ("warning", "X003", "running build.sh <output-dir>%s shows: the script failed with "
             "exit status 1, and %s: the trace cannot tell whether it builds what the manifest "
             "says (build, with the toolchain, can)" % (arch, why)) for arch in (" 80", "")])

    def test_cmake_with_the_cuda_language_cannot_be_told(self):
        if shutil.which("cmake") is None:
            self.skipTest("cmake is not installed")
        if shutil.which("nvcc") is not None:
            self.skipTest("nvcc answers CMake's checks here (ToolkitProbesTest."
                          "test_a_cmake_cuda_project_gets_past_cmakes_checks)")
        self.backend('cmake -S . -B "$1" && cmake --build "$1"\n', **{
            "backends/cuda/k/CMakeLists.txt": "cmake_minimum_required(VERSION 3.18)\n"
            "project(k LANGUAGES CUDA)\nadd_library(k SHARED k.cu)\n"
            "set_target_properties(k PROPERTIES CUDA_ARCHITECTURES 80)\n"})
        rc, report, err = self.trace()
        self.assertEqual(rc, 0, err)
        self.assertCannotTell(report, "it runs cmake, whose compiler checks build and run test "
                              "programs that the shims only stand in for")

    def test_a_program_the_script_builds_runs(self):
        self.backend('echo "int main(void) { return 0; }" > "$TMPDIR/probe.c"\n'
                     'cc -o "$1/probe" "$TMPDIR/probe.c"\n"$1/probe"\n'
                     'nvcc -arch=sm_80 -shared -o "$1/libk.so" k.cu\n')
        rc, report, err = self.trace()
        self.assertEqual((rc, report["results"][0]["issues"]), (0, []), err)

    def test_a_script_that_checks_what_its_program_prints_cannot_be_told(self):
        self.backend('echo "int main(void) { return 0; }" > "$TMPDIR/probe.c"\n'
                     'cc -o "$1/probe" "$TMPDIR/probe.c"\n"$1/probe" | grep -q ok\n'
                     'nvcc -arch=sm_80 -shared -o "$1/libk.so" k.cu\n')
        rc, report, err = self.trace()
        self.assertEqual(rc, 0, err)
        self.assertCannotTell(report, "it runs <output-dir>/probe, which a shim wrote in place "
                              "of compiling it")

    def test_nm_and_strip_read_the_shims_library(self):
        self.backend('nvcc -arch=sm_80 -shared -o "$1/libk.so" k.cu\nstrip "$1/libk.so"\n'
                     'nm -D "$1/libk.so"\nobjdump -T "$1/libk.so" > /dev/null\n')
        rc, report, err = self.trace()
        self.assertEqual((rc, report["results"][0]["issues"]), (0, []), err)
        self.assertNotIn("X001", err)

    def test_a_symbol_looked_for_in_the_shims_library_cannot_be_told(self):
        # The shim's library defines the ABI's two functions (k_abi_version), no other.
        self.backend('nvcc -arch=sm_80 -shared -o "$1/libk.so" k.cu\n'
                     'nm -D "$1/libk.so" | grep -q k_twice\n')
        rc, report, err = self.trace()
        self.assertEqual(rc, 0, err)
        self.assertCannotTell(report, "it runs nm on <output-dir>/libk.so, which a shim wrote "
                              "in place of compiling it")

    def test_a_version_check_cannot_be_told(self):
        self.backend('nvcc --version | grep -q "release 99\\."\n'
                     'nvcc -arch=sm_80 -shared -o "$1/libk.so" k.cu\n')
        rc, report, err = self.trace()
        self.assertEqual(rc, 0, err)
        self.assertCannotTell(report, "it asks nvcc its version, which a shim answers")

    def test_the_shims_nvcc_says_the_machines_cuda_release(self):
        nvcc = shutil.which("nvcc")
        if nvcc is None:
            self.skipTest("nvcc is not installed")
        real = subprocess.run([nvcc, "--version"], stdout=subprocess.PIPE,
                              universal_newlines=True, check=True).stdout
        release = re.search(r"release ([0-9.]+),", real).group(1)
        self.backend('nvcc --version | grep -q "release %s,"\n'
                     'nvcc -arch=sm_80 -shared -o "$1/libk.so" k.cu\n' % release)
        rc, report, err = self.trace()
        self.assertEqual((rc, report["results"][0]["issues"]), (0, []), err)

    def test_a_script_removing_the_depfiles_passes(self):
        self.backend('nvcc -MD -c -arch=sm_80 -Xcompiler -fPIC k.cu -o "$1/k.o"\n'
                     'nvcc -arch=sm_80 -shared -o "$1/libk.so" "$1/k.o"\nrm "$1"/*.d "$1/k.o"\n')
        rc, report, err = self.trace()
        self.assertEqual((rc, report["results"][0]["issues"]), (0, []), err)

    def test_a_script_removing_what_nvcc_keep_leaves_cannot_be_told(self):
        self.backend('nvcc -keep -arch=sm_80 -shared -o "$1/libk.so" k.cu\nrm k.cudafe1.cpp\n')
        rc, report, err = self.trace()
        self.assertEqual(rc, 0, err)
        self.assertCannotTell(report, "its last command (rm k.cudafe1.cpp) may need the files "
                              "that nvcc -keep leaves, which a shim does not write")

    def test_a_script_reading_the_linker_map_cannot_be_told(self):
        self.backend('nvcc -arch=sm_80 -c -Xcompiler -fPIC -o k.o k.cu\n'
                     'cc -shared -Wl,-Map="$TMPDIR/k.map" -o "$1/libk.so" k.o\n'
                     'test -s "$TMPDIR/k.map"\n')
        rc, report, err = self.trace()
        self.assertEqual(rc, 0, err)
        self.assertCannotTell(report, "its last command (test -s $TMPDIR/k.map) may need "
                              "the files that cc -Wl,-Map=$TMPDIR/k.map leaves, which a shim does "
                              "not write")

    def test_a_script_asking_git_its_version_and_using_a_submodule_passes(self):
        library = tempfile.mkdtemp()
        self.addCleanup(shutil.rmtree, library)
        write_tree(library, {"lib.h": "#define SUBVER 7\n"})
        git_in(library, "init", "-q")
        git_in(library, "add", "-A")
        git_in(library, "commit", "-q", "-m", "lib")
        self.backend('ver=$(git describe --always --dirty)\n'
                     'grep -q SUBVER ../../../third_party/lib/lib.h\n'
                     'if grep -rq SECRET "$(git rev-parse --git-dir)"; then exit 3; fi\n'
                     '[ -z "$(git remote)" ] || exit 4\n'
                     'nvcc -arch=sm_80 -shared -DVERSION="$ver" -I../../../third_party/lib '
                     '-o "$1/libk.so" k.cu\n')
        git_in(self.root, "init", "-q")
        git_in(self.root, "config", "http.https://github.com/.extraheader",
               "AUTHORIZATION: basic SECRET")
        git_in(self.root, "-c", "protocol.file.allow=always", "submodule", "add", library,
               "third_party/lib")
        git_in(self.root, "add", "-A")
        git_in(self.root, "commit", "-q", "-m", "k")
        git_in(self.root, "tag", "-a", "v1.0", "-m", "v1.0")
        version = subprocess.run(["git", "-C", self.root, "describe", "--always", "--dirty"],
                                 stdout=subprocess.PIPE, universal_newlines=True,
                                 check=True).stdout.strip()
        self.assertEqual(version, "v1.0")
        rc, report, err = self.trace()
        self.assertEqual((rc, report["results"][0]["issues"]), (0, []), err)
        self.assertEqual([r["defines"] for r in report["results"][0]["runs"]],
                         [["-DVERSION=v1.0"]] * 2)

    def test_the_shims_leave_the_files_the_real_compilers_leave(self):
        # Each call run by the real compiler and by its shim, in a directory
        # of its own: the same files are left (their contents differ).
        calls = [["gcc", "-MD", "-c", "s/m.c"], ["gcc", "-MMD", "-c", "s/m.c", "-o", "x.o"],
                 ["gcc", "-c", "s/m.c", "sub/a.c"], ["gcc", "-S", "s/m.c"],
                 ["gcc", "-MD", "s/m.c", "-o", "prog"], ["gcc", "-MD", "s/m.c", "sub/a.c"],
                 ["gcc", "-MD", "-MF", "deps", "-c", "s/m.c", "-o", "out/y"],
                 ["gcc", "-MD", "-shared", "-fPIC", "sub/a.c", "-o", "libk.so"],
                 ["gcc", "-M", "s/m.c"], ["gcc", "-E", "s/m.c", "-o", "/dev/null"]]
        if shutil.which("nvcc") is not None:
            calls += [["nvcc", "-MD", "-c", "s/k.cu"], ["nvcc", "-ptx", "s/k.cu"],
                      ["nvcc", "-MMD", "-fatbin", "-arch=sm_80", "s/k.cu", "-o", "out/k.fb"]]
        sources = {"s/m.c": "int main(void) { return 0; }\n", "sub/a.c": "int f(void);\n",
                   "s/k.cu": "__global__ void k() {}\n"}
        with tempfile.TemporaryDirectory() as top:
            os.mkdir(os.path.join(top, "calls"))
            shims = check_contract.Shims(os.path.join(top, "toolkit"), os.path.join(top, "calls"),
                                         os.devnull, check_contract.MachineNvcc())
            try:
                for index, words in enumerate(calls):
                    left = []
                    for compiler in (shutil.which(words[0]), os.path.join(shims.toolkit, "bin",
                                                                          words[0])):
                        where = os.path.join(top, "%d-%d" % (index, len(left)))
                        write_tree(where, dict(sources, **{"out/.keep": ""}))
                        subprocess.run([compiler] + words[1:], cwd=where, check=True,
                                       stdout=subprocess.DEVNULL)
                        left.append(sorted(os.path.relpath(os.path.join(d, n), where)
                                           for d, _, names in os.walk(where) for n in names))
                    self.assertEqual(left[1], left[0], words)
            finally:
                shims.close()


CMAKE_BUILD = Executable(
    '#!/bin/bash\nset -eu\nmkdir -p "$1"\nout=$(cd "$1" && pwd)\ncd "$(dirname "$0")"\n'
    'cmake -S . -B "$out/build" -DCMAKE_BUILD_TYPE=Release >/dev/null\ncmake --build "$out/build"\n'
    'cp "$out/build/libk.so" "$out/libk.so"\n')


@unittest.skipUnless(shutil.which("cmake") and shutil.which("cc"), "cmake or cc is not installed")
class ToolkitProbesTest(TreeTest):
    """The shims pass for the toolkit where build systems test it."""

    def cmake_backend(self, platform, source, languages, architectures, options=""):
        self.tree({
            "backends/%s/k/k.backend.json" % platform: {
                "name": "k", "abi_version": 1, "status": "experimental", "sources": [source],
                "build": {"script": "build.sh", "output": "libk.so", "architectures": architectures}},
            "backends/%s/k/%s" % (platform, source): "#define K_ABI_VERSION 1\n"
            "int k_abi_version(void) { return K_ABI_VERSION; }\n",
            "backends/%s/k/CMakeLists.txt" % platform: "cmake_minimum_required(VERSION 3.18)\n"
            "project(k %s)\nadd_library(k SHARED %s)\n%s" % (languages, source, options),
            "backends/%s/k/build.sh" % platform: CMAKE_BUILD})

    def test_cmakes_compiler_probes_are_not_the_build(self):
        # CMake identifies cc with -mcpu=cortex-m3 and -D__CLASSIC_C__ among its tries.
        self.cmake_backend("cpu", "k.c", "C", ["x86-64"],
                           "target_compile_options(k PRIVATE -march=x86-64)\n")
        rc, out, err = run_main(["--repo-root", self.root, "trace", "--format", "json"])
        (result,) = json.loads(out)["results"]
        self.assertEqual((rc, result["issues"]), (0, []), out)
        default = result["runs"][0]
        self.assertEqual((default["targets"], default["defines"]),
                         (["x86-64"], ["-Dk_EXPORTS", "-DNDEBUG"]))
        self.assertTrue(any("CMakeScratch" in c["cwd"] and c["probe"] for c in default["calls"]))

    def test_the_toolkit_holds_the_headers_a_toolkit_check_looks_for(self):
        self.tree({"backends/cpu/k/k.backend.json": {
            "name": "k", "abi_version": 1, "status": "experimental", "sources": ["k.c"],
            "build": {"script": "build.sh", "output": "libk.so", "architectures": ["x86-64"]}},
            "backends/cpu/k/k.c": "#define K_ABI_VERSION 1\n",
            "backends/cpu/k/build.sh": Executable(
                '#!/bin/sh\nset -eu\ntest -f "$CUDA_HOME/include/cuda_runtime.h"\n'
                'grep -q "define CUDART_VERSION" "$CUDA_PATH/include/cuda_runtime_api.h"\n'
                'test -f "$ROCM_PATH/include/hip/hip_runtime.h"\n'
                'mkdir -p "$1"\ncc -shared -march=x86-64 -o "$1/libk.so" "$(dirname "$0")/k.c"\n')})
        rc, out, err = run_main(["--repo-root", self.root, "trace", "--format", "json"])
        (result,) = json.loads(out)["results"]
        self.assertEqual((rc, result["issues"]), (0, []), out)
        with tempfile.TemporaryDirectory() as top:
            check_contract.toolkit_headers(os.path.join(top, "include"))
            header = os.path.join(top, "include", "cuda_runtime.h")
            if os.path.isdir("/usr/local/cuda/include"):  # the machine's own, not a stand-in
                self.assertEqual(os.path.realpath(header),
                                 os.path.realpath("/usr/local/cuda/include/cuda_runtime.h"))

    @unittest.skipUnless(all(shutil.which(t) for t in ("nm", "objdump", "strip")),
                         "binutils is not installed")
    def test_the_library_a_shim_writes_passes_nm_objdump_and_strip(self):
        self.tree({"backends/cpu/k/k.backend.json": {
            "name": "k", "abi_version": 1, "status": "experimental", "sources": ["k.c"],
            "build": {"script": "build.sh", "output": "libk.so", "architectures": ["x86-64"]}},
            "backends/cpu/k/k.c": "#define K_ABI_VERSION 1\nint k_abi_version(void) { return 1; }\n"
                                  "const char *k_error_string(int c) { return \"\"; }\n",
            "backends/cpu/k/build.sh": Executable(
                '#!/bin/bash\nset -euo pipefail\nmkdir -p "$1"\n'
                'cc -shared -fPIC -march=x86-64 -o "$1/libk.so" "$(dirname "$0")/k.c"\n'
                'nm -D --defined-only "$1/libk.so" | grep -q " T k_abi_version$"\n'
                'objdump -T "$1/libk.so" | grep -q k_error_string\n'
                'strip --strip-unneeded "$1/libk.so"\nnm -D "$1/libk.so" | grep -q k_abi_version\n')})
        rc, out, err = run_main(["--repo-root", self.root, "build", "--out", self.path("out")])
        self.assertEqual(rc, 0, out)  # the real build passes its own checks
        rc, out, err = run_main(["--repo-root", self.root, "trace", "--format", "json"])
        (result,) = json.loads(out)["results"]
        self.assertEqual((rc, result["issues"]), (0, []), out)

    @unittest.skipUnless(NVCC, "nvcc is not installed")
    def test_a_cmake_cuda_project_gets_past_cmakes_checks(self):
        # CMake learns the toolkit from nvcc -v and its compiler-id builds, which the real
        # nvcc answers, and links with the g++ on nvcc's PATH: the shim's, reading CMake's
        # @objects1 response file.
        self.cmake_backend("cuda", "k.cu", "CUDA", [80], "set_target_properties(k PROPERTIES "
                           "CUDA_ARCHITECTURES 80)\n")
        rc, out, err = run_main(["--repo-root", self.root, "trace", "--format", "json"])
        (result,) = json.loads(out)["results"]
        self.assertEqual((rc, result["issues"]), (0, []), out)
        default = result["runs"][0]
        self.assertEqual((default["targets"], default["output"]), (["80"], "<output-dir>/build/libk.so"))
        link = default["calls"][-1]["words"]
        self.assertEqual((link[0], "@CMakeFiles/k.dir/objects1" in link), ("g++", True), link)

    def test_a_response_file_gives_its_flags(self):
        self.tree({"backends/cpu/k/k.backend.json": {
            "name": "k", "abi_version": 1, "status": "experimental", "sources": ["k.c"],
            "build": {"script": "build.sh", "output": "libk.so", "architectures": ["haswell"]}},
            "backends/cpu/k/k.c": "#define K_ABI_VERSION 1\nint k_abi_version(void) { return 1; }\n"
                                  "const char *k_error_string(int c) { return \"\"; }\n",
            "backends/cpu/k/flags": "-march=haswell -fPIC\n",
            "backends/cpu/k/build.sh": Executable(
                '#!/bin/sh\nset -eu\nmkdir -p "$1"\nout=$(cd "$1" && pwd)\ncd "$(dirname "$0")"\n'
                'cc @flags -shared -o "$out/libk.so" k.c\n')})
        self.assertIssue("B017", "cannot tell whether build.sh builds haswell: @flags, a file of "
                         "options the checker cannot read at line 6", level="warning")
        rc, out, err = run_main(["--repo-root", self.root, "build", "--out", self.path("out")])
        self.assertEqual(rc, 0, out)  # gcc reads the file
        rc, out, err = run_main(["--repo-root", self.root, "trace", "--format", "json"])
        (result,) = json.loads(out)["results"]
        self.assertEqual((rc, result["issues"], result["runs"][0]["targets"]), (0, [], ["haswell"]), out)

    def test_cc_answers_what_it_is_as_the_real_cc(self):
        real = [subprocess.run(["cc", option], stdout=subprocess.PIPE, universal_newlines=True,
                               check=True).stdout.strip() for option in ("--version", "-dumpmachine")]
        self.tree({"backends/cpu/k/k.backend.json": {
            "name": "k", "abi_version": 1, "status": "experimental", "sources": ["k.c"],
            "build": {"script": "build.sh", "output": "libk.so", "architectures": ["x86-64"]}},
            "backends/cpu/k/k.c": "#define K_ABI_VERSION 1\n",
            "backends/cpu/k/build.sh": Executable(
                '#!/bin/sh\nset -eu\n[ "$(cc --version)" = %s ]\n[ "$(${CC:-cc} -dumpmachine)" = %s ]\n'
                'mkdir -p "$1"\ncc -shared -march=x86-64 -o "$1/libk.so" "$(dirname "$0")/k.c"\n'
                % tuple(shlex.quote(r) for r in real))})
        rc, out, err = run_main(["--repo-root", self.root, "trace", "--format", "json"])
        (result,) = json.loads(out)["results"]
        self.assertEqual((rc, result["issues"]), (0, []), out)


class TraceAgreesWithRealBuildTest(unittest.TestCase):
    def test_trace_agrees_with_a_real_cc_build_of_the_cpu_backend(self):
        if shutil.which("cc") is None or shutil.which("make") is None:
            self.skipTest("cc or make is not installed")
        with tempfile.TemporaryDirectory() as out:
            real = subprocess.run([os.path.join(HERE, "backends/cpu/llm_ops/build.sh"), out],
                                  stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                  universal_newlines=True)
            self.assertEqual(real.returncode, 0, real.stdout)
            check_contract.read_shared_object(os.path.join(out, "libllmops_cpu.so"))
            built = sorted(os.path.relpath(os.path.join(top, name), out)
                           for top, dirs, files in os.walk(out) for name in files
                           if name.endswith((".o", ".so")))
            with open(os.path.join(out, "obj", "flags")) as handle:  # the Makefile's compile line
                marches = re.findall(r"-march=(\S+)", handle.read())
        rc, stdout, err = run_main(["--repo-root", HERE, "trace", "cpu/llm_ops", "--format", "json"])
        self.assertEqual(rc, 0, stdout)
        default_run = json.loads(stdout)["results"][0]["runs"][0]
        self.assertEqual(default_run["landed"], "libllmops_cpu.so")
        self.assertEqual([w for w in default_run["written"] if w.endswith((".o", ".so"))], built)
        self.assertEqual(default_run["targets"], marches)
        self.assertEqual(marches, ["x86-64"])


class InitTraceTest(TreeTest):
    LOOP_BUILD = Executable(
        '#!/usr/bin/env bash\nset -eu\nmkdir -p "$1"\nout=$(cd "$1" && pwd)\ncd "$(dirname "$0")"\n'
        'archs=$(cat archs.txt)\nflags=()\n'
        'for a in $archs; do flags+=(-gencode "arch=compute_$a,code=sm_$a"); done\n'
        'nvcc -shared "${flags[@]}" -o "$out/libk.so" k.cu\n')

    def init(self, *args):
        return run_main(["--repo-root", self.root, "init", self.path("backends/cuda/k")] + list(args))

    def backend(self, script, name="k"):
        self.tree({"backends/cuda/%s/k.cu" % name: "#define K_ABI_VERSION 3\n",
                   "backends/cuda/%s/archs.txt" % name: "80 90\n",
                   "backends/cuda/%s/build.sh" % name: script})

    def manifest(self):
        with open(self.path("backends/cuda/k/k.backend.json")) as handle:
            return json.load(handle)

    def test_init_writes_what_the_traced_script_builds(self):
        self.backend(self.LOOP_BUILD)
        rc, out, err = self.init()
        self.assertEqual(err, "")
        self.assertTrue(out.startswith("wrote "), out)
        self.assertEqual(self.manifest()["build"], {"script": "build.sh", "output": "libk.so",
                                                    "architectures": [80, 90]})

    def test_init_no_trace_reads_the_script_only(self):
        self.backend(self.LOOP_BUILD)
        rc, out, err = self.init("--no-trace")
        self.assertEqual((rc, out), (1, ""))
        self.assertIn("init: cannot tell which architectures build.sh builds", err)
        self.assertFalse(os.path.exists(self.path("backends/cuda/k/k.backend.json")))

    def test_init_refuses_a_script_that_fails_under_the_shims(self):
        self.backend(Executable('#!/usr/bin/env bash\nset -eu\narchs=$(cat archs.txt)\n'
                                'nvcc -arch=sm_$archs -shared -o "$1/libk.so" k.cu\n'))
        rc, out, err = self.init()
        self.assertEqual((rc, out), (1, ""))
        self.assertEqual(err, "check_contract.py: error: init: build.sh cannot be run with the "
                         "compiler shims in place (it failed with exit status 1: cat: archs.txt: "
                         "No such file or directory); make it run as ./build.sh <output-dir>, or "
                         "give --no-trace to read it without running it\n")
        self.assertFalse(os.path.exists(self.path("backends/cuda/k/k.backend.json")))

    def test_init_names_a_command_the_machine_does_not_have(self):
        self.backend(Executable('#!/usr/bin/env bash\nset -eu\nmkdir -p "$1"\n'
                                'check-contract-no-such-tool --make-archs\n'
                                'nvcc -arch=sm_80 -shared -o "$1/libk.so" k.cu\n'))
        rc, out, err = self.init()
        self.assertEqual((rc, out), (1, ""))
        self.assertEqual(err, "check_contract.py: error: init: build.sh runs "
                         "check-contract-no-such-tool, which is not on its PATH (exit status "
                         "127); install it where the script finds it, or give --no-trace to read "
                         "the script without running it\n")

    def test_init_shows_the_output_directory_in_every_word(self):
        self.backend(Executable('#!/usr/bin/env bash\nmkdir -p "$1"\n'
                                'nvcc -arch=$1 -shared -o "$1/libk.so" k.cu\n'))
        rc, out, err = self.init()
        self.assertEqual((rc, out), (1, ""))
        self.assertEqual(err, "check_contract.py: error: init: cannot tell which architectures "
                         "build.sh builds (-arch=<output-dir>, whose code <output-dir> nvcc does "
                         "not read); give each target in a flag of its own (-gencode, -arch or "
                         "-code) and run init again, or write the manifest yourself\n")

    def test_init_refuses_a_compiler_the_shims_cannot_see(self):
        self.backend(Executable('#!/usr/bin/env bash\nset -eu\nmkdir -p "$1"\n'
                                'nvcc=%s/bin/nvcc\n[ -x "$nvcc" ] || nvcc=/usr/local/cuda/bin/nvcc\n'
                                '"$nvcc" --version > /dev/null 2>&1 || true\n'
                                'nvcc -arch=sm_80 -shared -o "$1/libk.so" k.cu\n'
                                % self.path("fake-cuda")))
        rc, out, err = self.init()
        self.assertEqual((rc, out), (1, ""))
        self.assertEqual(err, "check_contract.py: error: init: build.sh runs the compiler "
                         "/usr/local/cuda/bin/nvcc by its path, which the trace cannot intercept "
                         "(X001); call it by name or through $NVCC/$CC/$CXX/$HIPCC, or give --no-trace to "
                         "read the script without running it\n")

    def test_init_writes_the_manifest_of_a_script_removing_the_objects_it_compiled(self):
        self.backend(Executable('#!/usr/bin/env bash\nset -eu\nmkdir -p "$1"\ncd "$(dirname "$0")"\n'
                                'nvcc -MMD -c -arch=sm_80 -Xcompiler -fPIC k.cu\n'
                                'nvcc -arch=sm_80 -shared -o "$1/libk.so" k.o\nrm k.o k.d\n'))
        rc, out, err = self.init()
        self.assertEqual((rc, err), (0, ""), out)
        self.assertEqual(self.manifest()["build"], {"script": "build.sh", "output": "libk.so",
                                                    "architectures": [80], "default_arch": 80})

    def test_init_never_writes_a_manifest_its_check_rejects(self):
        self.backend(Executable('#!/usr/bin/env bash\nmkdir -p "$1"\n'
                                'nvcc -arch=sm_80 -shared -o "$1/libk.so" k.cu\n'), name="Fast-K")
        rc, out, err = run_main(["--repo-root", self.root, "init", self.path("backends/cuda/Fast-K")])
        self.assertEqual((rc, out), (1, ""))
        self.assertEqual(err, "check_contract.py: error: init: the manifest inferred from %s would "
                         "not pass the check: \"name\" must be a string of lowercase letters, "
                         "digits and _, not \"Fast-K\"; nothing was written\n"
                         % self.path("backends/cuda/Fast-K"))
        self.assertEqual(sorted(os.listdir(self.path("backends/cuda/Fast-K"))),
                         ["archs.txt", "build.sh", "k.cu"])


class InitHelpsTest(TreeTest):
    """init on scripts as real repositories write them: it writes what it can
    tell, says what the script must change, and names what it cannot tell."""

    def init(self, *args):
        return run_main(["--repo-root", self.root, "init", self.path("backends/cuda/k")] + list(args))

    def backend(self, script, name="build.sh", **extra):
        files = {"backends/cuda/k/k.cu": "#define K_ABI_VERSION 1\n",
                 "backends/cuda/k/" + name: Executable(script)}
        files.update(extra)
        self.tree(files)

    def manifest(self):
        with open(self.path("backends/cuda/k/k.backend.json")) as handle:
            return json.load(handle)

    def test_a_library_written_elsewhere_is_written_down_and_the_fix_named(self):
        self.backend('#!/usr/bin/env bash\nset -eu\ncd "$(dirname "$0")"\nmkdir -p build\n'
                     'nvcc -arch=sm_80 -shared -o build/libk.so k.cu\nmkdir -p "$1"\n'
                     'cp build/libk.so "$1/"\n')
        rc, out, err = self.init()
        self.assertEqual((rc, err), (1, ""), out)
        self.assertEqual(self.manifest()["build"], {"script": "build.sh", "output": "libk.so",
                                                    "architectures": [80], "default_arch": 80})
        self.assertTrue(out.endswith(
            "init: build.sh writes its library to backends/cuda/k/build/libk.so, not into its "
            "<output-dir> argument, where the build tier and CI look for it: write it with -o "
            "\"$1/libk.so\"\n"), out)

    def test_the_library_is_the_file_left_in_the_output_directory(self):
        self.backend('#!/usr/bin/env bash\nset -eu\ncd "$(dirname "$0")"\nmkdir -p "$1"\n'
                     'nvcc -arch=sm_80 -shared -o "$1/libk_tmp.so" k.cu\nmv "$1/libk_tmp.so" "$1/libk.so"\n')
        for reading in ((), ("--no-trace",)):
            with self.subTest(reading=reading):
                rc, out, err = self.init("--force", *reading)
                self.assertEqual((rc, err), (0, ""), out)
                self.assertEqual(self.manifest()["build"]["output"], "libk.so")

    def test_a_generated_file_git_ignores_is_no_source(self):
        self.backend('#!/usr/bin/env bash\nset -eu\ncd "$(dirname "$0")"\nmkdir -p "$1"\n'
                     'nvcc -arch=sm_80 -shared -o "$1/libk.so" k.cu\n',
                     **{"backends/cuda/k/gen/table.cu": "", ".gitignore": "gen/\n"})
        subprocess.run(["git", "init", "-q", self.root], check=True)
        rc, out, err = self.init("--no-trace")
        self.assertEqual((rc, err), (0, ""), out)
        self.assertEqual(self.manifest()["sources"], ["k.cu"])

    def test_the_targets_are_those_of_the_calls_that_make_the_library(self):
        self.backend('#!/usr/bin/env bash\nset -eu\ncd "$(dirname "$0")"\nmkdir -p "$1" build\n'
                     'clang++ --cuda-gpu-arch=sm_70 -c k.cu -o build/probe.o\n'
                     'nvcc -shared -o "$1/libk.so" k.cu\n')
        for reading in ((), ("--no-trace",)):
            with self.subTest(reading=reading):
                rc, out, err = self.init(*reading)
                self.assertEqual((rc, out), (1, ""))
                self.assertEqual(err, "check_contract.py: error: init: cannot tell which architectures "
                                 "build.sh builds (no target flag); give each target in a flag of its "
                                 "own (-gencode, -arch or -code) and run init again, or write the "
                                 "manifest yourself\n")
        self.backend('#!/usr/bin/env bash\nset -eu\nmkdir -p "$1"\n'
                     'nvcc -shared -arch=compute_80 -o "$1/libk.so" "$(dirname "$0")/k.cu"\n')
        rc, out, err = self.init("--no-trace")
        self.assertIn("(it builds only PTX (compute_80), which is compiled when the library is loaded, "
                      "no machine code)", err)

    def test_a_message_shows_the_output_directory_as_1(self):
        self.backend('#!/usr/bin/env bash\nset -eu\nmkdir -p "$1"\n'
                     'nvcc -shared -arch="$1" -o "$1/libk.so" "$(dirname "$0")/k.cu"\n')
        rc, out, err = self.init("--no-trace")
        self.assertEqual(rc, 1)
        self.assertNotIn("\x02", err)
        self.assertIn("-arch=$1", err)

    def test_a_script_without_a_shebang_gets_the_checks_words(self):
        self.backend('mkdir -p "$1"\nnvcc -arch=sm_80 -shared -o "$1/libk.so" k.cu\n')
        rc, out, err = self.init()
        self.assertEqual((rc, out), (1, ""))
        self.assertEqual(err, "check_contract.py: error: init: build script build.sh has no #! "
                         "line, so ./build.sh cannot run; start it with #!/usr/bin/env bash "
                         "(B014); or give --no-trace to read it without running it\n")

    def test_a_compiler_called_by_its_path_is_named_before_the_script_runs(self):
        with tempfile.TemporaryDirectory() as elsewhere:
            nvcc, stamp = os.path.join(elsewhere, "nvcc"), os.path.join(elsewhere, "ran")
            write_tree(elsewhere, {"nvcc": Executable("#!/bin/sh\ntouch %s\n" % stamp)})
            self.backend('#!/usr/bin/env bash\nmkdir -p "$1"\n'
                         '%s -arch=sm_80 -shared -o "$1/libk.so" k.cu\n' % nvcc)
            rc, out, err = self.init()
            self.assertFalse(os.path.exists(stamp), "init ran the script")
        self.assertEqual((rc, out), (1, ""))
        self.assertEqual(err, "check_contract.py: error: init: build.sh line 3 runs the compiler "
                         "%s by its path, which the trace cannot intercept (X001); call it by name "
                         "or through $NVCC/$CC/$CXX/$HIPCC, or give --no-trace to read the script "
                         "without running it\n" % nvcc)

    def test_several_scripts_and_no_build_sh_is_a_value_it_cannot_tell(self):
        self.backend('#!/bin/sh\necho benchmarking\n', name="bench.sh",
                     **{"backends/cuda/k/compile.sh": Executable("#!/bin/sh\nexit 0\n")})
        rc, out, err = self.init()
        self.assertEqual((rc, out), (1, ""))
        self.assertEqual(err, "check_contract.py: error: init %s: cannot tell which script builds "
                         "the backend: bench.sh, compile.sh; name it build.sh, or write the "
                         "manifest yourself\n" % self.path("backends/cuda/k"))

    def test_the_only_script_is_run_and_named(self):
        self.backend('#!/bin/sh\nmkdir -p "$1"\nnvcc -arch=sm_80 -shared -o "$1/libk.so" k.cu\n',
                     name="compile.sh")
        rc, out, err = self.init()
        self.assertEqual((rc, err), (0, ""), out)
        self.assertTrue(out.startswith(
            "init: compile.sh is the only *.sh here, so build.script; running "
            "./backends/cuda/k/compile.sh <output-dir> with the compiler shims in place\nwrote "), out)
        self.assertEqual(self.manifest()["build"]["script"], "compile.sh")

    @unittest.skipUnless(shutil.which("cmake") and NVCC, "cmake or nvcc is not installed")
    def test_a_cmake_cuda_build_is_told_as_the_real_build_makes_it(self):
        # CMake's checks run the real nvcc, which picks the default target: the real build agrees.
        self.backend('#!/usr/bin/env bash\nset -e\ncmake -S "$(dirname "$0")" -B "$1"\n'
                     'cmake --build "$1"\n', **{
                         "backends/cuda/k/CMakeLists.txt": "cmake_minimum_required(VERSION 3.18)\n"
                         "project(k LANGUAGES CUDA)\nadd_library(k SHARED k.cu)\n"
                         "set_target_properties(k PROPERTIES CUDA_VISIBILITY_PRESET hidden)\n",
                         "backends/cuda/k/k.cu": TINY_CU.replace("GPUTINY", "K").replace("gputiny", "k")})
        rc, out, err = self.init()
        self.assertEqual(rc, 0, out + err)
        build = self.manifest()["build"]
        self.assertEqual(build["output"], "libk.so")
        rc, out, err = run_main(["--repo-root", self.root, "build", "--out", self.path("out")])
        self.assertEqual(rc, 0, out)
        library = check_contract.read_shared_object(self.path("out/cuda/k/libk.so"))
        self.assertEqual(check_contract.cuda_targets(library)[0], {str(a) for a in build["architectures"]})

    def test_cmake_is_a_value_it_cannot_tell_and_says_why(self):
        if shutil.which("cmake") is None:
            self.skipTest("cmake is not installed")
        if NVCC is not None:
            self.skipTest("nvcc answers CMake's checks here "
                          "(test_a_cmake_cuda_build_is_told_as_the_real_build_makes_it)")
        self.backend('#!/usr/bin/env bash\nset -e\ncmake -S "$(dirname "$0")" -B "$1"\n'
                     'cmake --build "$1"\n', **{
                         "backends/cuda/k/CMakeLists.txt": "cmake_minimum_required(VERSION 3.18)\n"
                         "project(k LANGUAGES CUDA)\nadd_library(k SHARED k.cu)\n"})
        rc, out, err = self.init()
        self.assertEqual((rc, out), (1, ""))
        self.assertEqual(err, "check_contract.py: error: init: cannot tell what build.sh builds: "
                         "it failed with exit status 1, and it runs cmake, whose compiler checks "
                         "build and run test programs that the shims only stand in for; write "
                         "the manifest yourself and check it with build, or give --no-trace to "
                         "read the script without running it\n")


# The corpus: build scripts written the way real repositories write them, CUDA, HIP and
# CPU, mixing the constructs the script reader is asked to follow.  Each entry: name,
# platform, the script, other files ({path from the backend directory: text}), the
# construct the reader is not asked to follow (None: it must agree with the trace),
# and the truth, recorded from `trace`: the library and the targets that the default
# invocation's compiler calls build.  test_corpus_truth_is_what_trace_shows keeps
# the truth honest.
BUILD_SCRIPT_CORPUS = [
    ('cu_home_pick', 'cuda', r'''#!/usr/bin/env bash
# Build: ./build.sh <output-dir> [<sm>]
set -euo pipefail
out=$1
arch=${2:-89}
nvcc=${NVCC:-}
if [ -z "$nvcc" ]; then
    if [ -n "${CUDA_HOME:-}" ]; then nvcc=$CUDA_HOME/bin/nvcc; else nvcc=$(command -v nvcc); fi
fi
mkdir -p "$out"
cd "$(dirname "$0")"
"$nvcc" -O3 -std=c++17 -Xcompiler -fPIC -shared \
    -gencode "arch=compute_${arch},code=[sm_${arch},compute_${arch}]" \
    -o "$out/libcu_home_pick.so" k.cu
''',
     {}, None, ('<output-dir>/libcu_home_pick.so', ['89'])),
    ('cu_fat_array', 'cuda', r'''#!/usr/bin/env bash
set -euo pipefail
if [ $# -lt 1 ]; then echo "usage: $0 <out> [<cc>]" >&2; exit 2; fi
if [ $# -ge 2 ]; then
  gencode=(-gencode "arch=compute_$2,code=sm_$2")
else
  gencode=(-gencode arch=compute_75,code=sm_75
           -gencode arch=compute_86,code=sm_86
           -gencode "arch=compute_90,code=[sm_90,compute_90]")
fi
mkdir -p "$1"
out_dir=$(cd "$1" && pwd)
cd "$(dirname "$0")"
"${NVCC:-nvcc}" -O2 -shared -Xcompiler -fPIC "${gencode[@]}" -o "$out_dir/libcu_fat_array.so" k.cu
''',
     {}, None, ('<output-dir>/libcu_fat_array.so', ['75', '86', '90'])),
    ('cu_arch_flag', 'cuda', r'''#!/bin/bash
set -e
OUT="$1"
LIB="$OUT/libcu_arch_flag.so"
SRC_DIR="$( cd "$( dirname "${BASH_SOURCE[0]}" )" && pwd )"
mkdir -p "$OUT"
nvcc -arch=sm_80 -O3 --use_fast_math -Xcompiler -fPIC -shared "$SRC_DIR/k.cu" -o "$LIB"
echo "built $LIB"
''',
     {}, None, ('<output-dir>/libcu_arch_flag.so', ['80'])),
    ('cu_code_list', 'cuda', r'''#!/usr/bin/env bash
set -eu
mkdir -p "$1"
here=$(dirname "$0")
# one virtual architecture, machine code for two real ones
nvcc -arch=compute_80 -code=sm_80,sm_86 -shared -Xcompiler -fPIC \
     -o "$1/libcu_code_list.so" "$here/k.cu"
''',
     {}, None, ('<output-dir>/libcu_code_list.so', ['80', '86'])),
    ('cu_arch_specific', 'cuda', r'''#!/usr/bin/env bash
set -euo pipefail
out="${1:?usage: build.sh <output-dir>}"
mkdir -p "$out"
cd "$(dirname "$0")"
nvcc -std=c++17 -O3 -Xcompiler -fPIC -shared \
  -gencode arch=compute_90,code=sm_90 \
  -gencode=arch=compute_90a,code=sm_90a \
  -o "${out}/libcu_arch_specific.so" k.cu
''',
     {}, None, ('<output-dir>/libcu_arch_specific.so', ['90', '90a'])),
    ('cu_backticks', 'cuda', r'''#!/bin/bash
TOP=`pwd`
OUT=$1
HERE=`dirname $0`
mkdir -p $OUT
cd $HERE
nvcc -O3 -shared -Xcompiler -fPIC -gencode arch=compute_86,code=sm_86 -o $OUT/libcu_backticks.so k.cu
cd $TOP
''',
     {}, None, ('<output-dir>/libcu_backticks.so', ['86'])),
    ('cu_patterns', 'cuda', r'''#!/usr/bin/env bash
set -euo pipefail
src=k.cu
lib=lib${src%.cu}_kernels.so
name=${lib#lib}
tag=sm-89
mkdir -p "$1"
cd "${0%/*}"
nvcc -shared -Xcompiler -fPIC -arch=${tag/-/_} -o "$1/libcu_patterns.so" "$src"
echo "${name%.so} done"
''',
     {}, None, ('<output-dir>/libcu_patterns.so', ['89'])),
    ('cu_ccache', 'cuda', r'''#!/usr/bin/env bash
set -euo pipefail
mkdir -p "$1"
cd "$(dirname "$0")"
CCACHE_DISABLE=1 ccache nvcc -O3 -shared -Xcompiler -fPIC \
    -gencode arch=compute_80,code=sm_80 -o "$1/libcu_ccache.so" k.cu
''',
     {}, None, ('<output-dir>/libcu_ccache.so', ['80'])),
    ('cu_default_assign', 'cuda', r'''#!/usr/bin/env bash
set -eu
: "${CUDA_ARCH:=86}"
: "${OPT:=-O3}"
mkdir -p "$1"
cd "$(dirname "$0")"
nvcc $OPT -shared -Xcompiler -fPIC -gencode arch=compute_${CUDA_ARCH},code=sm_${CUDA_ARCH} \
  -o "$1/libcu_default_assign.so" k.cu
''',
     {}, None, ('<output-dir>/libcu_default_assign.so', ['86'])),
    ('cu_shift', 'cuda', r'''#!/usr/bin/env bash
set -euo pipefail
out=$1
shift
arch=${1:-90}
mkdir -p "$out"
cd "$(dirname "$0")"
nvcc -shared -Xcompiler -fPIC -gencode arch=compute_$arch,code=sm_$arch -o "$out/libcu_shift.so" k.cu
''',
     {}, None, ('<output-dir>/libcu_shift.so', ['90'])),
    ('cu_oneline_if', 'cuda', r'''#!/usr/bin/env bash
set -euo pipefail
if [ $# -ge 2 ]; then sm=$2; else sm=80; fi
mkdir -p "$1"; cd "$(dirname "$0")"
nvcc -O3 -shared -Xcompiler -fPIC -arch=sm_$sm -o "$1/libcu_oneline_if.so" k.cu
''',
     {}, None, ('<output-dir>/libcu_oneline_if.so', ['80'])),
    ('cu_heredoc', 'cuda', r'''#!/usr/bin/env bash
set -euo pipefail
out=$1
mkdir -p "$out"
cd "$(dirname "$0")"
cat > "$out/README.txt" <<EOF
Built by build.sh. To rebuild by hand:
  nvcc -arch=sm_70 -shared -o libold.so k.cu
EOF
cat > "$out/version.h" <<'EOF'
#define BUILT_WITH "nvcc -o /tmp/other.so"
EOF
nvcc -O3 -shared -Xcompiler -fPIC -arch=sm_89 -o "$out/libcu_heredoc.so" k.cu
''',
     {}, None, ('<output-dir>/libcu_heredoc.so', ['89'])),
    ('cu_sourced_env', 'cuda', r'''#!/usr/bin/env bash
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
. "$here/arch.env"
mkdir -p "$1"
nvcc -O3 -shared -Xcompiler -fPIC -gencode arch=compute_${SM},code=sm_${SM} \
  -o "$1/${LIBNAME}" "$here/k.cu"
''',
     {'arch.env': '# targets of this backend\nSM=86\nLIBNAME=libcu_sourced_env.so\n'}, None, ('<output-dir>/libcu_sourced_env.so', ['86'])),
    ('cu_env_branch', 'cuda', r'''#!/usr/bin/env bash
set -euo pipefail
if [ -n "${DEBUG:-}" ]; then
    flags="-G -O0"
    arch=75
else
    flags="-O3 -lineinfo"
    arch=90
fi
mkdir -p "$1"
cd "$(dirname "$0")"
nvcc $flags -shared -Xcompiler -fPIC -arch=sm_$arch -o "$1/libcu_env_branch.so" k.cu
''',
     {}, None, ('<output-dir>/libcu_env_branch.so', ['90'])),
    ('cu_out_by_arg', 'cuda', r'''#!/usr/bin/env bash
set -euo pipefail
if [ -n "${2:-}" ]; then
  lib=libcu_out_by_arg_sm$2.so; gen="-gencode arch=compute_$2,code=sm_$2"
else
  lib=libcu_out_by_arg.so; gen="-gencode arch=compute_80,code=sm_80 -gencode arch=compute_90,code=sm_90"
fi
mkdir -p "$1"
cd "$(dirname "$0")"
nvcc -shared -Xcompiler -fPIC $gen -o "$1/$lib" k.cu
''',
     {}, None, ('<output-dir>/libcu_out_by_arg.so', ['80', '90'])),
    ('cu_probe', 'cuda', r'''#!/usr/bin/env bash
set -euo pipefail
mkdir -p "$1"
cd "$(dirname "$0")"
nvcc --version > /dev/null
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
printf 'int main(void) { return 0; }\n' > "$tmp/probe.c"
if cc -fopenmp "$tmp/probe.c" -o /dev/null 2>/dev/null; then omp=-Xcompiler=-fopenmp; else omp=; fi
nvcc -O3 -shared -Xcompiler -fPIC $omp -arch=sm_86 -o "$1/libcu_probe.so" k.cu
cc -x c -E - -o /dev/null < /dev/null
''',
     {}, None, ('<output-dir>/libcu_probe.so', ['86'])),
    ('cu_run_wrapper', 'cuda', r'''#!/usr/bin/env bash
set -euo pipefail
run() {
    echo "+ $*"
    "$@"
}
out=$1
mkdir -p "$out"
cd "$(dirname "$0")"
run nvcc -O3 -shared -Xcompiler -fPIC -gencode arch=compute_89,code=sm_89 -o "$out/libcu_run_wrapper.so" k.cu
''',
     {}, None, ('<output-dir>/libcu_run_wrapper.so', ['89'])),
    ('cu_for_literal', 'cuda', r'''#!/usr/bin/env bash
set -euo pipefail
gencode=""
for sm in 80 86 89; do
    gencode="$gencode -gencode arch=compute_$sm,code=sm_$sm"
done
mkdir -p "$1"
cd "$(dirname "$0")"
nvcc -O3 -shared -Xcompiler -fPIC $gencode -o "$1/libcu_for_literal.so" k.cu
''',
     {}, None, ('<output-dir>/libcu_for_literal.so', ['80', '86', '89'])),
    ('cu_out_elsewhere', 'cuda', r'''#!/usr/bin/env bash
set -euo pipefail
cd "$(dirname "$0")"
mkdir -p build
nvcc -O3 -shared -Xcompiler -fPIC -arch=sm_80 -o build/libcu_out_elsewhere.so k.cu
mkdir -p "$1"
cp build/libcu_out_elsewhere.so "$1/"
''',
     {}, None, ('backends/cuda/cu_out_elsewhere/build/libcu_out_elsewhere.so', ['80'])),
    ('cu_native', 'cuda', r'''#!/usr/bin/env bash
set -euo pipefail
mkdir -p "$1"
cd "$(dirname "$0")"
nvcc -O3 -shared -Xcompiler -fPIC -arch=native -o "$1/libcu_native.so" k.cu
''',
     {}, None, ('<output-dir>/libcu_native.so', [])),
    ('cu_case_arg', 'cuda', r'''#!/usr/bin/env bash
set -euo pipefail
case "${2:-all}" in
    all) gencode=(-gencode arch=compute_80,code=sm_80 -gencode arch=compute_90,code=sm_90) ;;
    *)   gencode=(-gencode "arch=compute_$2,code=sm_$2") ;;
esac
mkdir -p "$1"
cd "$(dirname "$0")"
nvcc -shared -Xcompiler -fPIC "${gencode[@]}" -o "$1/libcu_case_arg.so" k.cu
''',
     {}, None, ('<output-dir>/libcu_case_arg.so', ['80', '90'])),
    ('cu_cuda_home_default', 'cuda', r'''#!/usr/bin/env bash
set -euo pipefail
CUDA_HOME=${CUDA_HOME:-/usr/local/cuda}
NVCC="$CUDA_HOME/bin/nvcc"
mkdir -p "$1"
cd "$(dirname "$0")"
"$NVCC" -O3 -shared -Xcompiler -fPIC -I"$CUDA_HOME/include" -arch=sm_75 \
    -o "$1/libcu_cuda_home_default.so" k.cu -L"$CUDA_HOME/lib64" -lcudart
''',
     {}, None, ('<output-dir>/libcu_cuda_home_default.so', ['75'])),
    ('cu_abi_define', 'cuda', r'''#!/usr/bin/env bash
set -euo pipefail
ABI=1
mkdir -p "$1"
cd "$(dirname "$0")"
nvcc -O3 -shared -Xcompiler -fPIC -DK_ABI_VERSION=$ABI -DNDEBUG -arch=sm_90 \
    -o "$1/libcu_abi_define.so" k.cu
''',
     {}, None, ('<output-dir>/libcu_abi_define.so', ['90'])),
    ('cu_two_step', 'cuda', r'''#!/usr/bin/env bash
set -euo pipefail
out=$(mkdir -p "$1" && cd "$1" && pwd)
obj=$out/obj
mkdir -p "$obj"
cd "$(dirname "$0")"
nvcc -c -O3 -Xcompiler -fPIC -gencode arch=compute_86,code=sm_86 -o "$obj/k.o" k.cu
g++ -shared -o "$out/libcu_two_step.so" "$obj/k.o" -L/usr/local/cuda/lib64 -lcudart
''',
     {}, None, ('<output-dir>/libcu_two_step.so', ['86'])),
    ('cu_ccbin', 'cuda', r'''#!/usr/bin/env bash
set -euo pipefail
HOST_CXX=g++-12
mkdir -p "$1"
cd "$(dirname "$0")"
nvcc -ccbin "$HOST_CXX" -O3 -shared -Xcompiler -fPIC -arch=sm_89 -o "$1/libcu_ccbin.so" k.cu
''',
     {}, None, ('<output-dir>/libcu_ccbin.so', ['89'])),
    ('cu_python_flags', 'cuda', r'''#!/usr/bin/env bash
set -euo pipefail
flags=$(python3 -c "print(' '.join('-gencode=arch=compute_%d,code=sm_%d' % (a, a) for a in (80, 90)))")
mkdir -p "$1"
cd "$(dirname "$0")"
nvcc -O3 -shared -Xcompiler -fPIC $flags -o "$1/libcu_python_flags.so" k.cu
''',
     {}, 'command substitution', ('<output-dir>/libcu_python_flags.so', ['80', '90'])),
    ('cu_mapfile', 'cuda', r'''#!/usr/bin/env bash
set -euo pipefail
cd "$(dirname "$0")"
mapfile -t archs < archs.txt
gencode=()
for a in "${archs[@]}"; do gencode+=(-gencode "arch=compute_$a,code=sm_$a"); done
mkdir -p "$1"
nvcc -O3 -shared -Xcompiler -fPIC "${gencode[@]}" -o "$1/libcu_mapfile.so" k.cu
''',
     {'archs.txt': '80\n89\n'}, 'mapfile', ('<output-dir>/libcu_mapfile.so', ['80', '89'])),
    ('cu_for_cat', 'cuda', r'''#!/usr/bin/env bash
set -euo pipefail
here=$(dirname "$0")
flags=""
for a in $(cat "$here/archs.txt"); do flags="$flags -gencode arch=compute_$a,code=sm_$a"; done
mkdir -p "$1"
nvcc -shared -Xcompiler -fPIC $flags -o "$1/libcu_for_cat.so" "$here/k.cu"
''',
     {'archs.txt': '75 90\n'}, 'for loop', ('<output-dir>/libcu_for_cat.so', ['75', '90'])),
    ('cu_common_outside', 'cuda', r'''#!/usr/bin/env bash
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
source "$here/../../common_cuda.sh"
mkdir -p "$1"
nvcc $COMMON_FLAGS -shared -o "$1/libcu_common_outside.so" "$here/k.cu"
''',
     {'../../common_cuda.sh': "COMMON_FLAGS='-O3 -Xcompiler -fPIC -gencode arch=compute_80,code=sm_80'\n"}, 'sourced file', ('<output-dir>/libcu_common_outside.so', ['80'])),
    ('cu_eval', 'cuda', r'''#!/usr/bin/env bash
set -euo pipefail
mkdir -p "$1"
cd "$(dirname "$0")"
cmd="nvcc -O3 -shared -Xcompiler -fPIC -arch=sm_86 -o $1/libcu_eval.so k.cu"
eval "$cmd"
''',
     {}, 'eval', ('<output-dir>/libcu_eval.so', ['86'])),
    ('hip_offload_list', 'hip', r'''#!/usr/bin/env bash
set -euo pipefail
mkdir -p "$1"
cd "$(dirname "$0")"
hipcc -O3 -fPIC -shared --offload-arch=gfx90a,gfx942 -o "$1/libhip_offload_list.so" k.hip
''',
     {}, None, ('<output-dir>/libhip_offload_list.so', ['gfx90a', 'gfx942'])),
    ('hip_repeated', 'hip', r'''#!/usr/bin/env bash
set -euo pipefail
ROCM_PATH=${ROCM_PATH:-/opt/rocm}
mkdir -p "$1"
cd "$(dirname "$0")"
"$ROCM_PATH/bin/hipcc" -O3 -fPIC -shared \
    --offload-arch=gfx908 \
    --offload-arch=gfx90a:xnack+ \
    -o "$1/libhip_repeated.so" k.hip
''',
     {}, None, ('<output-dir>/libhip_repeated.so', ['gfx908', 'gfx90a:xnack+'])),
    ('hip_mcpu', 'hip', r'''#!/usr/bin/env bash
set -euo pipefail
ROCM=${ROCM_PATH:-/opt/rocm}
mkdir -p "$1"
cd "$(dirname "$0")"
"$ROCM/llvm/bin/clang" -x hip --cuda-device-only -target amdgcn-amd-amdhsa -mcpu=gfx908 \
    -O3 -o "$1/hip_mcpu.co" k.hip
''',
     {}, None, ('<output-dir>/hip_mcpu.co', ['gfx908'])),
    ('hip_amdgpu_target', 'hip', r'''#!/usr/bin/env bash
set -e
OUT=$1
[ -d "$OUT" ] || mkdir -p "$OUT"
cd "$(dirname "$0")"
hipcc -O2 -fPIC -shared --amdgpu-target=gfx906 -o "$OUT/libhip_amdgpu_target.so" k.hip
''',
     {}, None, ('<output-dir>/libhip_amdgpu_target.so', ['gfx906'])),
    ('hip_genco', 'hip', r'''#!/usr/bin/env bash
set -euo pipefail
mkdir -p "$1"
cd "$(dirname "$0")"
hipcc --genco --targets gfx900,gfx906 k.hip -o "$1/hip_genco.hsaco"
''',
     {}, None, ('<output-dir>/hip_genco.hsaco', ['gfx900', 'gfx906'])),
    ('hip_generic', 'hip', r'''#!/usr/bin/env bash
set -euo pipefail
HIPCC=${HIPCC:-hipcc}
mkdir -p "$1"
cd "$(dirname "$0")"
$HIPCC -O3 -fPIC -shared --offload-arch=gfx11-generic -o "$1/libhip_generic.so" k.hip
''',
     {}, None, ('<output-dir>/libhip_generic.so', ['gfx11-generic'])),
    ('hip_gpu_targets', 'hip', r'''#!/usr/bin/env bash
set -euo pipefail
GPU_TARGETS=${GPU_TARGETS:-gfx90a;gfx942}
mkdir -p "$1"
cd "$(dirname "$0")"
hipcc -O3 -fPIC -shared --offload-arch=${GPU_TARGETS//;/,} -o "$1/libhip_gpu_targets.so" k.hip
''',
     {}, None, ('<output-dir>/libhip_gpu_targets.so', ['gfx90a', 'gfx942'])),
    ('hip_while_read', 'hip', r'''#!/usr/bin/env bash
set -euo pipefail
cd "$(dirname "$0")"
archs=()
while read -r target; do
    archs+=("--offload-arch=$target")
done < targets.txt
mkdir -p "$1"
hipcc -O3 -fPIC -shared "${archs[@]}" -o "$1/libhip_while_read.so" k.hip
''',
     {'targets.txt': 'gfx90a\ngfx942\n'}, 'while loop', ('<output-dir>/libhip_while_read.so', ['gfx90a', 'gfx942'])),
    ('hip_clang_versioned', 'hip', r'''#!/usr/bin/env bash
set -euo pipefail
CXX=${CXX:-clang++-18}
mkdir -p "$1"
cd "$(dirname "$0")"
"$CXX" -x hip --offload-arch=gfx942 -O3 -fPIC -shared -o "$1/libhip_clang_versioned.so" k.hip
''',
     {}, None, ('<output-dir>/libhip_clang_versioned.so', ['gfx942'])),
    ('hip_amdclang_func', 'hip', r'''#!/usr/bin/env bash
set -euo pipefail
compile() {
    local arch=$1 lib=$2
    amdclang++ -x hip --offload-arch="$arch" -O3 -fPIC -shared -o "$lib" k.hip
}
mkdir -p "$1"
out=$(cd "$1" && pwd)
cd "$(dirname "$0")"
compile gfx942 "$out/libhip_amdclang_func.so"
''',
     {}, None, ('<output-dir>/libhip_amdclang_func.so', ['gfx942'])),
    ('cpu_march_default', 'cpu', r'''#!/usr/bin/env bash
set -euo pipefail
march=${2:-x86-64}
mkdir -p "$1"
cd "$(dirname "$0")"
cc -O2 -fPIC -shared -march="$march" -o "$1/libcpu_march_default.so" k.c -lm
''',
     {}, None, ('<output-dir>/libcpu_march_default.so', ['x86-64'])),
    ('cpu_gcc12_default', 'cpu', r'''#!/usr/bin/env bash
set -eu
: "${MARCH:=x86-64-v2}"
mkdir -p "$1"
cd "$(dirname "$0")"
gcc-12 -O3 -fPIC -shared -march=$MARCH -o "$1/libcpu_gcc12_default.so" k.c
''',
     {}, None, ('<output-dir>/libcpu_gcc12_default.so', ['x86-64-v2'])),
    ('cpu_ccache_prefix', 'cpu', r'''#!/bin/sh
set -e
mkdir -p "$1"
cd "$(dirname "$0")"
CCACHE_DISABLE=1 cc -O2 -fPIC -shared -march=x86-64-v3 -o "$1/libcpu_ccache_prefix.so" k.c
''',
     {}, None, ('<output-dir>/libcpu_ccache_prefix.so', ['x86-64-v3'])),
    ('cpu_make', 'cpu', r'''#!/usr/bin/env bash
set -euo pipefail
mkdir -p "$1"
out=$(cd "$1" && pwd)
cd "$(dirname "$0")"
make --no-print-directory OUT="$out"
''',
     {'Makefile': 'OUT ?= .\nCFLAGS = -O2 -fPIC -march=x86-64\n\n$(OUT)/libcpu_make.so: k.c\n\t$(CC) $(CFLAGS) -shared -o $@ $<\n'}, 'make', ('<output-dir>/libcpu_make.so', ['x86-64'])),
    ('cpu_for_sources', 'cpu', r'''#!/usr/bin/env bash
set -euo pipefail
out=$(mkdir -p "$1" && cd "$1" && pwd)
cd "$(dirname "$0")"
mkdir -p "$out/obj"
for f in k util; do
    cc -O2 -fPIC -march=x86-64 -c $f.c -o "$out/obj/$f.o"
done
cc -shared -o "$out/libcpu_for_sources.so" "$out/obj/k.o" "$out/obj/util.o"
''',
     {'util.c': 'int util(void) { return 0; }\n'}, None, ('<output-dir>/libcpu_for_sources.so', ['x86-64'])),
    ('cpu_function', 'cpu', r'''#!/usr/bin/env bash
set -euo pipefail
build_lib() {
    local out=$1 march=$2
    ${CC:-cc} -O2 -fPIC -shared -march=$march -o "$out/libcpu_function.so" k.c
}
mkdir -p "$1"
out=$(cd "$1" && pwd)
cd "$(dirname "$0")"
build_lib "$out" x86-64-v2
''',
     {}, None, ('<output-dir>/libcpu_function.so', ['x86-64-v2'])),
    ('cpu_cc_var', 'cpu', r'''#!/usr/bin/env bash
set -euo pipefail
CC=${CC:-cc}
CFLAGS="-O2 -fPIC -march=x86-64"
mkdir -p "$1"
cd "$(dirname "$0")"
$CC $CFLAGS -shared -o "$1/libcpu_cc_var.so" k.c
''',
     {}, None, ('<output-dir>/libcpu_cc_var.so', ['x86-64'])),
    ('cpu_eval', 'cpu', r'''#!/usr/bin/env bash
set -euo pipefail
mkdir -p "$1"
cd "$(dirname "$0")"
eval "cc -O2 -fPIC -shared -march=x86-64 -o $1/libcpu_eval.so k.c"
''',
     {}, 'eval', ('<output-dir>/libcpu_eval.so', ['x86-64'])),
    ('cpu_march_file', 'cpu', r'''#!/usr/bin/env bash
set -euo pipefail
cd "$(dirname "$0")"
march=$(cat march.txt)
mkdir -p "$1"
cc -O2 -fPIC -shared -march="$march" -o "$1/libcpu_march_file.so" k.c
''',
     {'march.txt': 'x86-64-v3\n'}, 'command substitution', ('<output-dir>/libcpu_march_file.so', ['x86-64-v3'])),
    ('cpu_clang_versioned', 'cpu', r'''#!/usr/bin/env bash
set -euo pipefail
mkdir -p "$1"
cd "$(dirname "$0")"
clang-18 -O2 -fPIC -shared -march=x86-64-v2 -o "$1/libcpu_clang_versioned.so" k.c
''',
     {}, None, ('<output-dir>/libcpu_clang_versioned.so', ['x86-64-v2'])),
]


CORPUS_SOURCES = {"cuda": "k.cu", "hip": "k.hip", "cpu": "k.c"}
CORPUS_PLACEHOLDER_TARGETS = {"cuda": 80, "hip": "gfx90a", "cpu": "x86-64"}
# How a warning names each construct the reader is not asked to follow.
CORPUS_CONSTRUCTS = {
    "command substitution": r"\$\(|command substitution|output of a command|command's output",
    "mapfile": r"\bmapfile\b", "for loop": r"\bfor\b[^;]*\bloop", "while loop": r"\bwhile\b",
    "sourced file": r"\bsource|\bsourced\b", "eval": r"\beval\b", "make": r"\bmake\b"}
# Where the script reader still disagrees with the trace: name -> what it gets wrong.
# A script that comes to agree may leave this list; no other may join it.
CORPUS_DISAGREEMENTS = {}


def corpus_backend(name, platform, script, extra, truth):
    """The files of a backend built by a corpus script, with the manifest the
    trace shows to be true."""
    output, targets = truth
    library = output[len("<output-dir>/"):] if output.startswith("<output-dir>/") else \
        output.rsplit("/", 1)[-1]
    archs = [int(t) if t.isdigit() else t for t in targets] or [CORPUS_PLACEHOLDER_TARGETS[platform]]
    top = "backends/%s/%s/" % (platform, name)
    files = {
        top + name + ".backend.json": {
            "name": name, "abi_version": 1, "status": "experimental",
            "sources": ["k.h", CORPUS_SOURCES[platform]] + sorted(
                path for path in extra if path.endswith(check_contract.COMPILED_SUFFIXES)),
            "build": {"script": "build.sh", "output": library, "architectures": archs}},
        top + "k.h": "#define K_ABI_VERSION 1\nunsigned k_abi_version(void);\n"
                     "const char* k_error_string(int code);\n",
        top + CORPUS_SOURCES[platform]: '#include "k.h"\n',
        top + "build.sh": Executable(script)}
    files.update((posixpath.normpath(top + path), text) for path, text in extra.items())
    return files


class CorpusTest(unittest.TestCase):
    """Each corpus script is traced and read, with the manifest its trace shows
    to be true: one repository of the whole corpus, traced and checked once."""

    @classmethod
    def setUpClass(cls):
        with tempfile.TemporaryDirectory(prefix="check-contract-corpus-") as root:
            for name, platform, script, extra, construct, truth in BUILD_SCRIPT_CORPUS:
                write_tree(root, corpus_backend(name, platform, script, extra, truth))
            rc, out, err = run_main(["--repo-root", root, "trace", "--format", "json"])
            traced = {result["backend"]: result for result in json.loads(out)["results"]}
            rc, out, err = run_main(["--repo-root", root, "--format", "json"])
            issues = json.loads(out)["issues"]
        cls.results = {}
        for name, platform, script, extra, construct, truth in BUILD_SCRIPT_CORPUS:
            key = platform + "/" + name
            cls.results[name] = (traced[key], [i for i in issues if i["backend"] == key])
        # No finding is the repository's rather than one backend's.
        cls.unowned = [i for i in issues if i["backend"] not in traced]

    def test_corpus_is_large_and_covers_every_platform(self):
        self.assertEqual(self.unowned, [])
        self.assertGreaterEqual(len(BUILD_SCRIPT_CORPUS), 40)
        self.assertEqual(len({entry[0] for entry in BUILD_SCRIPT_CORPUS}), len(BUILD_SCRIPT_CORPUS))
        platforms = [entry[1] for entry in BUILD_SCRIPT_CORPUS]
        self.assertGreaterEqual(min(platforms.count(p) for p in ("cuda", "hip", "cpu")), 10)

    def test_corpus_truth_is_what_trace_shows(self):
        for name, platform, script, extra, construct, truth in BUILD_SCRIPT_CORPUS:
            traced, _ = self.results[name]
            default_run = traced["runs"][0]
            self.assertEqual(default_run["calls"] and (default_run["output"], default_run["targets"]),
                             truth, name)
            self.assertNotIn("R001", [i["code"] for i in traced["issues"]], name)

    def test_static_reader_agrees_with_the_trace(self):
        """With a true manifest, the reader reports what the trace reports; where a script
        uses a construct the reader does not follow, it never reports an error the trace
        does not, and a warning names the construct."""
        found = {}
        for name, platform, script, extra, construct, truth in BUILD_SCRIPT_CORPUS:
            traced, static = self.results[name]
            traced = [i for i in traced["issues"]
                      if i["message"].startswith("running build.sh <output-dir> shows: ")]
            static = [i for i in static if i["code"].startswith("B")]
            if construct is None:
                agrees = sorted(i["code"] for i in traced) == sorted(i["code"] for i in static)
            else:
                named = re.compile(CORPUS_CONSTRUCTS[construct], re.I)
                agrees = {i["code"] for i in static if i["level"] == "error"} <= {
                    i["code"] for i in traced if i["level"] == "error"} and any(
                    i["level"] == "warning" and named.search(i["message"]) for i in static)
            if not agrees:
                found[name] = "reads %s; the trace shows %s" % (
                    "; ".join("%s %s" % (i["code"], i["message"]) for i in static) or "no finding",
                    ", ".join(i["code"] for i in traced) or "no finding")
        new = {k: v for k, v in found.items() if k not in CORPUS_DISAGREEMENTS}
        self.assertEqual(new, {}, "the script reader and the trace now disagree on:\n%s" % "\n".join(
            "  %s: %s" % item for item in sorted(new.items())))
        names = {entry[0] for entry in BUILD_SCRIPT_CORPUS}
        self.assertLessEqual(set(CORPUS_DISAGREEMENTS), names)


class InitCorpusTest(unittest.TestCase):
    """init on every corpus script: a manifest whose output and targets agree
    with the trace, or a refusal naming the value it cannot tell."""

    def test_init_agrees_with_the_trace_or_names_what_it_cannot_tell(self):
        for name, platform, script, extra, construct, truth in BUILD_SCRIPT_CORPUS:
            with self.subTest(name=name), tempfile.TemporaryDirectory(
                    prefix="check-contract-corpus-") as root:
                files = corpus_backend(name, platform, script, extra, truth)
                top = "backends/%s/%s/" % (platform, name)
                del files[top + name + ".backend.json"]
                write_tree(root, files)
                rc, out, err = run_main(["--repo-root", root, "init", os.path.join(root, top)])
                output, targets = truth
                manifest = os.path.join(root, top, name + ".backend.json")
                if not os.path.exists(manifest):
                    self.assertEqual(rc, 1)
                    self.assertRegex(err, r"\Acheck_contract\.py: error: init: cannot tell which "
                                     r"(architectures|library) [^\n]*\n\Z")
                    continue
                with open(manifest) as handle:
                    build = json.load(handle)["build"]
                self.assertEqual(build["output"], posixpath.basename(output))
                self.assertEqual([str(a) for a in build["architectures"]], targets)
                elsewhere = not output.startswith("<output-dir>/")
                self.assertEqual(rc == 1 and "not into its <output-dir> argument" in out, elsewhere,
                                 out + err)


class TiersReportEveryBackendTest(TreeTest):
    """Every tier reports every backend it was asked for or found: failed or
    skipped with the reason, never left out of a run that then passes."""

    def results(self, *args):
        rc, out, err = self.check(*args, "--format", "json")
        return rc, [(r["backend"], r["result"], [(i["code"], i["message"]) for i in r["issues"]])
                    for r in json.loads(out)["results"]]

    def test_a_directory_without_a_manifest_fails_every_tier_that_is_asked_for_it(self):
        self.tree(demo_files(**{"backends/cuda/nomani/k.cu": "__global__ void k() {}\n"}))
        d001 = ("D001", "has kernel sources (k.cu) but no nomani.backend.json manifest; run: "
                "python3 check_contract.py init backends/cuda/nomani")
        for tier in ("build", "trace", "test", "parity"):
            with self.subTest(tier=tier):
                self.assertEqual(self.results(tier, "cuda/nomani"), (1, [("cuda/nomani", "failed", [d001])]))
        rc, results = self.results("test")
        self.assertEqual((rc, [r[:2] for r in results]), (1, [("cpu/demo", "skipped"), ("cuda/nomani", "failed")]))

    def test_trace_of_a_backend_the_check_rejects_is_r009(self):
        self.tree(demo_files(demo_manifest(abi_version="one")))
        rc, results = self.results("trace")
        self.assertEqual((rc, results), (1, [("cpu/demo", "failed", [(
            "R009", "not traceable: the contract check reports 1 error(s) (M002); run "
                    "check_contract.py check cpu/demo")])]))

    def test_tests_unittest_cannot_discover_are_a_failure(self):
        test = "import unittest\n\nclass T(unittest.TestCase):\n    def test_it(self):\n        pass\n"
        self.tree(demo_files(**{"backends/cpu/demo/tests/test_ops.py": test}))
        self.assertEqual(self.results("test"), (1, [("cpu/demo", "failed", [(
            "U001", "unittest would run none of the tests (tests/test_ops.py): tests/ has no "
                    "__init__.py, and unittest discovers tests only in packages; add "
                    "backends/cpu/demo/tests/__init__.py")])]))
        self.tree({"backends/cpu/demo/tests/__init__.py": ""})
        self.assertEqual(self.results("test"), (0, [("cpu/demo", "passed", [])]))

    def test_sarif_names_a_file_whose_name_is_not_utf8(self):
        self.tree(demo_files())
        with open(os.path.join(os.fsencode(self.path("backends/cpu/demo")), b"k\xff.c"), "w") as handle:
            handle.write("int k;\n")
        rc, out, err = self.check("--format", "sarif")
        result, = json.loads(out)["runs"][0]["results"]
        self.assertEqual((rc, err, result["ruleId"], result["locations"][0]["physicalLocation"][
            "artifactLocation"]["uri"]), (1, "", "S004", "backends/cpu/demo/k%FF.c"))


class TestTierTest(TreeTest):
    def run_tests(self, *args):
        return run_main(["--repo-root", self.root, "test"] + list(args))

    def test_backend_tests_run_from_the_repository_root(self):
        files = tiny_files()
        files["backends/cpu/tiny/tests/__init__.py"] = ""
        files["backends/cpu/tiny/tests/test_tiny.py"] = (
            "import os, unittest\n"
            "class T(unittest.TestCase):\n"
            "    def test_cwd_is_the_repository_root(self):\n"
            "        self.assertTrue(os.path.isdir('backends/cpu/tiny'))\n")
        self.tree(files)
        rc, out, err = self.run_tests()
        self.assertEqual(rc, 0, out)
        self.assertRegex(out, r"\] test_cwd_is_the_repository_root \(.*\) \.\.\. ok\n")
        self.assertRegex(out, r"\npassed cpu/tiny \([0-9.]+s\)\n1 backend\(s\) passed, 0 failed, 0 skipped\n\Z")

    def test_failing_backend_tests_fail_the_run(self):
        files = tiny_files()
        files["backends/cpu/tiny/tests/__init__.py"] = ""
        files["backends/cpu/tiny/tests/test_tiny.py"] = (
            "import unittest\nclass T(unittest.TestCase):\n    def test_no(self):\n        self.fail('no')\n")
        self.tree(files)
        rc, out, err = self.run_tests()
        self.assertEqual(rc, 1)
        self.assertIn("\nbackends/cpu/tiny: [error] U001 cpu/tiny: tests failed (exit status 1)\n"
                      "0 backend(s) passed, 1 failed, 0 skipped\n", out)

    def test_backend_without_tests_gets_a_warning_only_here(self):
        self.tree(tiny_files())
        self.assertEqual(self.run_tests(), (0, "skipped cpu/tiny: no tests\nbackends/cpu/tiny: [warning] "
                                          "U002 cpu/tiny: has no tests "
                                          "(test_*.py) beside its kernels; add them under "
                                          "backends/cpu/tiny/tests/\n0 backend(s) passed, 0 failed, 1 skipped\n", ""))
        rc, out, err = run_main(["--repo-root", self.root])
        self.assertEqual((rc, out), (0, "checked cpu/tiny: status=experimental abi=2\n"
                                        "1 backend(s), 0 error(s), 0 warning(s)\n"))

    def test_planned_backend_without_tests_gets_no_warning(self):
        self.tree(tiny_files(status="planned"))
        self.assertEqual(self.run_tests()[1], "skipped cpu/tiny: status is planned and there are no tests\n"
                                         "0 backend(s) passed, 0 failed, 1 skipped\n")


class ParityTierTest(TreeTest):
    def parity(self, script, *args, status="validated"):
        files = tiny_files(status=status)
        files["backends/cpu/tiny/parity.py"] = script
        self.tree(files)
        return run_main(["--repo-root", self.root, "parity"] + list(args))

    def test_passing_entrypoint(self):
        rc, out, err = self.parity("print('rmsnorm max error 1e-8 <= 1e-7')\n")
        self.assertEqual(rc, 0)
        self.assertRegex(out, r"^==> parity cpu/tiny: .*\n\[ *[0-9.]+s\] rmsnorm max error 1e-8 <= 1e-7\n"
                              r"passed cpu/tiny \([0-9.]+s\)\n1 backend\(s\) passed, 0 failed, 0 skipped\n\Z")

    def test_failing_entrypoint(self):
        rc, out, err = self.parity("import sys\nprint('too far')\nsys.exit(1)\n")
        self.assertEqual(rc, 1)
        self.assertIn("\nbackends/cpu/tiny/parity.py: [error] P001 cpu/tiny: backends/cpu/tiny/parity.py "
                      "failed (exit status 1)\n", out)

    def test_skip_line_means_skipped_with_the_reason(self):
        rc, out, err = self.parity("print('SKIP: no CUDA GPU here')\n", "--format", "json")
        self.assertEqual(rc, 0)
        result = json.loads(out)
        self.assertEqual((result["passed"], result["skipped"]), (0, 1))
        self.assertEqual(result["results"][0]["detail"], "no CUDA GPU here")
        self.assertRegex(err, r"\] SKIP: no CUDA GPU here\n")

    def test_skip_line_with_failure_exit_is_a_failure(self):
        rc, out, err = self.parity("import sys\nprint('SKIP: pretending')\nsys.exit(2)\n")
        self.assertEqual(rc, 1)
        self.assertIn("\nbackends/cpu/tiny/parity.py: [error] P001 cpu/tiny: backends/cpu/tiny/parity.py "
                      "failed (exit status 2)\n", out)

    def test_only_validated_backends_run_unless_named(self):
        self.assertEqual(self.parity("print('x')\n", status="experimental"),
                         (0, "0 backend(s) passed, 0 failed, 0 skipped\n", ""))
        rc, out, err = run_main(["--repo-root", self.root, "parity", "tiny"])
        self.assertEqual(rc, 0)
        self.assertIn("passed cpu/tiny (", out)



# ---------------------------------------------------------------- the repository itself


def copy_of_repository(dest):
    """A fresh git repository holding this checkout's tracked and untracked-not-ignored
    files as they are in the working tree, as a newcomer's clone would."""
    listing = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=HERE, check=True, stdout=subprocess.PIPE).stdout.decode().split("\0")
    for rel in filter(None, listing):
        src = os.path.join(HERE, rel)
        if not os.path.lexists(src):
            continue
        os.makedirs(os.path.dirname(os.path.join(dest, rel)), exist_ok=True)
        shutil.copy2(src, os.path.join(dest, rel), follow_symlinks=False)
    git = ["git", "-c", "user.name=t", "-c", "user.email=t@example.com"]
    subprocess.run(git + ["init", "-q"], cwd=dest, check=True)
    subprocess.run(git + ["add", "-A"], cwd=dest, check=True)
    subprocess.run(git + ["commit", "-qm", "copy"], cwd=dest, check=True)


def shown_shell(document, heading=None):
    """The ```sh blocks of `document` (a path relative to the repository), or
    of its section under `heading` (up to the next heading of the same or a
    higher level), and the output lines they promise: a line `#   text`
    after a command says the command prints the line `text`."""
    with open(os.path.join(HERE, document), encoding="utf-8") as f:
        lines = f.read().splitlines()
    if heading is not None:
        level = heading.split(" ", 1)[0]
        section, fenced = [], False
        for line in lines[lines.index(heading) + 1:]:
            fenced ^= line.startswith("```")
            if not fenced and re.match(r"#{1,%d} " % len(level), line):
                break
            section.append(line)
        lines = section
    script = "\n".join(re.findall(r"```sh\n(.*?)```", "\n".join(lines) + "\n", re.S))
    return script, [line[4:] for line in script.splitlines() if line.startswith("#   ")]


def normalise_shown(text):
    """What a shown output line may differ in: elapsed times and the random
    part of a mktemp name."""
    text = re.sub(r"\[ *[0-9]+\.[0-9]s\]", "[elapsed]", text)
    text = re.sub(r"\([0-9]+\.[0-9]s\)", "(elapsed)", text)
    return re.sub(r"(/tmp/[A-Za-z0-9_-]+\.)[A-Za-z0-9]{6}\b", r"\1XXXXXX", text)


def this_python_first(path):
    """PATH with the directory of the interpreter running the tests first,
    where its `python3` is that interpreter: the documents' `python3 ...`
    commands then run under the Python being tested, not under whatever
    PATH finds first (a version manager's shim, which also costs a shell
    script per start)."""
    directory = os.path.dirname(sys.executable)
    named = os.path.join(directory, "python3")
    if os.path.isfile(named) and os.path.samefile(named, sys.executable):
        return directory + os.pathsep + path
    return path


def run_in_clone(test, script, document):
    """Run `script` with bash in a fresh copy of the repository and return
    its output (stdout and stderr); the test fails unless it succeeds and
    leaves the copy as it was."""
    with tempfile.TemporaryDirectory() as clone, tempfile.TemporaryDirectory() as home:
        copy_of_repository(clone)
        # overlay_setup.py records applied overlays under $XDG_STATE_HOME
        env = terminal_env(XDG_STATE_HOME=home, PATH=this_python_first(os.environ["PATH"]))
        proc = subprocess.run(["bash", "-euo", "pipefail", "-c", script], cwd=clone, env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              universal_newlines=True, timeout=600)
        test.assertEqual(proc.returncode, 0, proc.stdout)
        status = subprocess.run(["git", "status", "--porcelain"], cwd=clone, check=True,
                                stdout=subprocess.PIPE, universal_newlines=True).stdout
        test.assertEqual(status, "", "the commands of %s left the clone changed" % document)
        return proc.stdout


def assert_shown(test, expected, output):
    """The output lines a document promises are in the output, in order."""
    test.assertGreater(len(expected), 3)
    lines = iter(normalise_shown(output).splitlines())
    for want in map(normalise_shown, expected):
        test.assertTrue(any(want == line for line in lines),
                        "output lacks the line %r (in this order):\n%s" % (want, output))


def run_shown(test, document, heading=None):
    """Run the ```sh blocks of `document` (see shown_shell) in a copy of the
    repository: they succeed and print the lines they promise."""
    script, expected = shown_shell(document, heading)
    assert_shown(test, expected, run_in_clone(test, script, document))


@unittest.skipUnless(shutil.which("git") and shutil.which("cc") and shutil.which("make"),
                     "the walkthrough needs git, cc and make")
class RepositoryTest(unittest.TestCase):
    # Echoed before and after the walkthrough's `apply ... --dry-run`, so that
    # one run of the walkthrough shows what that command printed.
    DRY_RUN_MARK = "@@ the output of the dry run begins or ends here @@"
    walkthrough_output = None  # one run for the class: it takes seconds

    def dry_run_span(self, script):
        """Where the walkthrough's `apply ... --dry-run` command starts and ends."""
        start = script.index("python3 overlay_setup.py apply")
        return start, script.index("--dry-run\n", start) + len("--dry-run\n")

    def walkthrough(self):
        """The README walkthrough's output, the dry run's between two
        DRY_RUN_MARK lines; run once for the class, as run_shown runs it."""
        if RepositoryTest.walkthrough_output is None:
            script = shown_shell("README.md", "## Walkthrough")[0]
            start, end = self.dry_run_span(script)
            mark = "echo '%s'\n" % self.DRY_RUN_MARK
            RepositoryTest.walkthrough_output = run_in_clone(
                self, script[:start] + mark + script[start:end] + mark + script[end:], "README.md")
        return RepositoryTest.walkthrough_output

    def test_readme_walkthrough_runs_as_written(self):
        output = self.walkthrough().replace(self.DRY_RUN_MARK + "\n", "")
        assert_shown(self, shown_shell("README.md", "## Walkthrough")[1], output)

    def test_check_contract_reference_commands_run_as_written(self):
        run_shown(self, "docs/check_contract.md")

    def test_the_readme_counts_the_lines_dry_run_prints(self):
        with open(os.path.join(HERE, "README.md"), encoding="utf-8") as f:
            shown, total = map(int, re.search(r"Below, (\d+) of the (\d+)\s+lines `--dry-run` "
                                              r"prints", f.read()).groups())
        script = shown_shell("README.md", "## Walkthrough")[0]
        start, end = self.dry_run_span(script)
        promised = re.match(r"(?:#   .*\n)*", script[end:]).group(0)
        self.assertEqual(promised.count("\n"), shown)
        _, begins, rest = self.walkthrough().partition(self.DRY_RUN_MARK + "\n")
        printed, ends, _ = rest.partition(self.DRY_RUN_MARK + "\n")
        self.assertTrue(begins and ends, self.walkthrough())
        self.assertEqual(len(printed.splitlines()), total, printed)

    def test_every_shell_block_of_the_readme_is_the_walkthrough(self):
        # The tests above run every ```sh block: none may sit outside what they run.
        self.assertEqual(shown_shell("README.md"), shown_shell("README.md", "## Walkthrough"))

    def test_bench_commands_take_the_options_shown(self):
        # The benchmarks take minutes: their commands are checked against their --help.
        with open(os.path.join(HERE, "bench", "README.md"), encoding="utf-8") as f:
            commands = re.findall(r"^    python3 (bench/\S+\.py)([^#\n]*)", f.read(), re.M)
        self.assertEqual(sorted({script for script, _ in commands}),
                         ["bench/bench_check_contract.py", "bench/bench_distribution.py",
                          "bench/bench_missing_sources.py", "bench/bench_overlay.py",
                          "bench/bench_speed.py", "bench/differential_reader.py",
                          "bench/mutation.py"])
        for script, args in commands:
            usage = subprocess.run([sys.executable, os.path.join(HERE, script), "--help"],
                                   stdout=subprocess.PIPE, universal_newlines=True, check=True).stdout
            for flag in re.findall(r"--[a-z][a-z-]*", args):
                self.assertIn(flag, usage, script)

    def test_the_test_files_run_at_once_and_fail_as_a_whole(self):
        # .ci/unittest_at_once.py runs the first half of the test command: the
        # second module's listing comes whole after the first's, and a failure
        # of either is the exit status, whichever order they are named in.
        with tempfile.TemporaryDirectory() as tmp:
            write_tree(tmp, {
                "slow_ok.py": "import time, unittest\nclass A(unittest.TestCase):\n"
                              "    def test_a(self):\n        time.sleep(0.3)\n",
                "quick_fail.py": "import unittest\nclass B(unittest.TestCase):\n"
                                 "    def test_b(self):\n        self.fail('b failed')\n"})

            def run(*modules):
                return subprocess.run([sys.executable, os.path.join(HERE, ".ci", "unittest_at_once.py")]
                                      + list(modules), cwd=tmp, stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, universal_newlines=True)
            done = run("slow_ok", "quick_fail")
            self.assertEqual(done.returncode, 1, done.stdout)
            first, second = done.stdout.split("test_b (", 1)
            self.assertIn("test_a (", first)
            self.assertIn("Ran 1 test in ", first)
            self.assertTrue(first.rstrip().endswith("\nOK"), done.stdout)
            self.assertIn("AssertionError: b failed\n", second)
            self.assertTrue(second.rstrip().endswith("\nFAILED (failures=1)"), done.stdout)
            self.assertEqual(run("quick_fail", "slow_ok").returncode, 1)
            done = run("slow_ok", "slow_ok")
            self.assertEqual((done.returncode, done.stdout.count("\nOK\n")), (0, 2), done.stdout)
            done = run()
            self.assertEqual((done.returncode, done.stdout), (
                2, "usage: python3 .ci/unittest_at_once.py MODULE [MODULE ...]\n"))

    def test_readme_fits_in_15_kb(self):
        self.assertLessEqual(os.path.getsize(os.path.join(HERE, "README.md")), 15000)

    def test_pre_commit_hook_runs_the_checker_from_a_clean_clone(self):
        # pre-commit runs a `language: script` hook as <hook repo clone>/<entry> <args>
        # from the root of the repository being committed to.
        with open(os.path.join(HERE, ".pre-commit-hooks.yaml"), encoding="utf-8") as f:
            hooks = f.read()
        self.assertIn("- id: check-contract", hooks)
        self.assertIn("language: script", hooks)
        entry = re.search(r"^\s*entry:\s*(.+)$", hooks, re.M).group(1).split()
        files = re.search(r"^\s*files:\s*(\S+)$", hooks, re.M).group(1)
        self.assertTrue(re.search(files, "backends/cuda/x/x.backend.json"))
        with tempfile.TemporaryDirectory() as tmp:
            hook_repo = os.path.join(tmp, "hook")
            copy_of_repository(hook_repo)
            clone = os.path.join(tmp, "clone")
            subprocess.run(["git", "clone", "-q", hook_repo, clone], check=True)
            user = os.path.join(tmp, "user")
            write_tree(user, {"backends/cuda/k/k.cu": "__global__ void k() {}\n"})
            proc = subprocess.run([os.path.join(clone, entry[0])] + entry[1:], cwd=user,
                                  env=terminal_env(), stdout=subprocess.PIPE,
                                  stderr=subprocess.STDOUT, universal_newlines=True)
            self.assertEqual(proc.returncode, 1, proc.stdout)
            self.assertIn("backends/cuda/k: [error] D001 cuda/k: has kernel sources (k.cu) but no "
                          "k.backend.json manifest; run: python3 check_contract.py init backends/cuda/k",
                          proc.stdout)



DOCUMENTS = ("README.md", "docs/check_contract.md", "docs/overlay_setup.md", "backends/README.md")
TOOL_MODULES = {"check_contract": check_contract, "overlay_setup": overlay_setup}


def tool_argv(tail):
    """The arguments of a command line shown after the tool's name, up to
    the first shell operator (`&&`, `;`, `|`, `>`, `)`), comment, or run of
    spaces before a description."""
    lexer = shlex.shlex(re.split(r"  +#?", tail)[0], posix=True, punctuation_chars="();|&>")
    lexer.whitespace_split = True
    argv = []
    try:
        for token in lexer:
            if token and all(c in lexer.punctuation_chars for c in token):
                break
            argv.append(token)
    except ValueError:  # a quote closed after the operator the command ends at
        pass
    return argv


def documented_commands():
    """[(where, tool module, argv)]: every command line of the two tools that
    the documents show outside their ```sh blocks (which tests run as
    written) and outside the synopses: code spans, indented lines, with
    backslash continuations joined, and the examples of every --help."""
    texts = []
    for document in DOCUMENTS:
        with open(os.path.join(HERE, document), encoding="utf-8") as handle:
            texts.append((document, re.sub(r"```sh\n.*?```", "", handle.read(), flags=re.S)))
    for name, tool in TOOL_MODULES.items():
        for command, parser in [(None, tool.build_parser())] + sorted(subcommands(tool.build_parser()).items()):
            texts.append(("%s.py %s--help" % (name, command + " " if command else ""), parser.format_help()))
    found = []
    for where, text in texts:
        for line in re.sub(r" *\\\n\s*", " ", text).splitlines():
            if "[--" in line:  # a synopsis line: [--option] forms, not a command
                continue
            for m in re.finditer(r"(?<![\w./-])(check_contract|overlay_setup)\.py( [^`\n]*)?", line):
                tool = TOOL_MODULES[m.group(1)]
                argv = tool_argv(m.group(2) or "")
                commands = subcommands(tool.build_parser())
                words = [w for w in argv if not w.startswith("-")]
                if argv and (argv[0].startswith("-") or argv[0] in commands) and \
                        (not words or words[0] in commands or tool is check_contract or "--state" in argv):
                    found.append((where, tool, argv))
    return found


class DocumentedCommandsTest(unittest.TestCase):
    """Every command the README, the references and the --help examples
    show is one the tools read: the ```sh blocks run as written (RepositoryTest,
    OverlayDocsTest), the rest are read by the tool's own parser, and those
    that name nothing to fill in run here."""

    def test_every_shell_block_is_in_a_document_whose_blocks_run(self):
        with_blocks = [d for d in DOCUMENTS + ("bench/README.md",) if shown_shell(d)[0]]
        self.assertEqual(with_blocks, ["README.md", "docs/check_contract.md", "docs/overlay_setup.md"])

    def test_every_documented_command_line_is_read_by_the_tool(self):
        commands = documented_commands()
        self.assertGreater(len(commands), 40)
        self.assertGreaterEqual(len({where for where, _, _ in commands}), 20)
        for where, tool, argv in commands:
            with self.subTest(where=where, argv=argv):
                if tool is check_contract:
                    argv, command = check_contract.with_default_command(argv)
                    parser = check_contract.build_parser(command)
                else:
                    if "trial" in argv and "--" in argv:
                        argv = argv[:argv.index("--")]
                    parser = overlay_setup.build_parser()
                if "--help" in argv or "--version" in argv or "..." in argv:
                    continue  # asks for no run, or leaves out arguments ("...")
                try:
                    parser.parse_args([word.replace("$$", str(os.getpid())) for word in argv])
                except (check_contract.CommandLineError, overlay_setup.CommandLineError) as exc:
                    self.fail("%s: %s" % (" ".join(argv), exc))

    def test_a_stale_option_in_a_document_is_found(self):
        # so that the test above can fail: status takes no --root
        self.assertEqual(tool_argv(' status --root "$PWD" | tail -n 1  # what it prints'),
                         ["status", "--root", "$PWD"])
        with self.assertRaises(overlay_setup.CommandLineError):
            overlay_setup.build_parser().parse_args(["status", "--root", "."])

    @unittest.skipUnless(shutil.which("git"), "the documented commands run in a git clone")
    def test_the_documented_commands_with_nothing_to_fill_in_run(self):
        # build, test and parity compile or run every backend: the
        # walkthrough and the reference run them on one backend each.
        runnable = sorted({(tool.__name__, tuple(argv)) for _, tool, argv in documented_commands()
                           if not re.search(r"[<$]|\b[A-Z]{3,}\b|/opt/|/tmp/|/work\b|\.diff$", " ".join(argv))
                           and not {"build", "test", "parity", "init"} & set(argv)
                           and all(os.path.exists(os.path.join(HERE, word)) for word in argv
                                   if re.search(r"\.\w+$", word) and not word.startswith("-"))})
        self.assertGreaterEqual(len(runnable), 8, runnable)
        with tempfile.TemporaryDirectory() as clone, tempfile.TemporaryDirectory() as home:
            copy_of_repository(clone)
            for name, argv in runnable:
                with self.subTest(argv=(name,) + argv):
                    done = subprocess.run([sys.executable, os.path.join(clone, name + ".py")] + list(argv),
                                          cwd=clone, env=terminal_env(XDG_STATE_HOME=home),
                                          stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                          universal_newlines=True, timeout=600)
                    self.assertIn(done.returncode, (0, 1), done.stderr)
                    self.assertNotIn("Traceback", done.stderr)


def readme_says(text):
    """Whether the README says `text` (whitespace as in a wrapped paragraph)."""
    with open(os.path.join(HERE, "README.md"), encoding="utf-8") as handle:
        return " ".join(text.split()) in " ".join(handle.read().split())


class DocumentedClaimsTest(TreeTest):
    """What the README and the references claim about the tools, each tried."""

    def test_the_checkers_exit_status_is_as_the_readme_gives_it(self):
        self.assertTrue(readme_says("Exit status 0 when nothing failed (warnings alone too), 1 an error "
                                    "(a warning, with `--strict`) or a failed run, 2 usage."))
        manifest = demo_manifest(status="experimental")
        manifest["min_capabilty"] = 80  # M003, a warning
        self.tree(demo_files(manifest))
        self.assertEqual([self.check(*args)[0] for args in ([], ["--strict"], ["--no-such-flag"])], [0, 1, 2])
        self.assertIn("[warning] M003", self.check()[1])
        self.tree(demo_files(demo_manifest(abi_version=2)))
        self.assertEqual(self.check()[0], 1)

    def test_root_is_taken_where_the_readme_says(self):
        sentence = ("`--root DIR` is the repository for every `check_contract.py` command; for "
                    "`overlay_setup.py` it is what a patch's paths are relative to (`apply`, `update`, "
                    "`trial`) or where `gc-stale` looks.")
        self.assertTrue(readme_says(sentence))
        overlay_commands = subcommands(overlay_setup.build_parser())
        named = [w for w in re.findall(r"`([a-z-]+)`", sentence) if w in overlay_commands]
        self.assertEqual(sorted(named), sorted(name for name, parser in overlay_commands.items()
                                               if "--root DIR" in parser.format_help()))
        for name in subcommands(check_contract.build_parser()):
            with self.subTest(command=name):
                args = check_contract.build_parser(name).parse_args(
                    [name, "--root", self.root] + (["backends/x"] if name == "init" else []))
                self.assertEqual(args.repo_root, self.root)

    def test_the_layout_line_names_every_checker_command(self):
        with open(os.path.join(HERE, "README.md"), encoding="utf-8") as handle:
            listed = re.search(r"^    check_contract\.py +the contract checker \(([^)]*)\)$",
                               handle.read(), re.M).group(1).split(", ")
        self.assertEqual(sorted(listed), sorted(subcommands(check_contract.build_parser())))

    def test_gc_stale_says_it_reverts_what_a_killed_run_left_halfway(self):
        # What it does: test_overlay_native.CrashIsACrashTest (a run killed
        # halfway is reverted under a live owner) and GcStaleTest.
        usage = " ".join(overlay_setup.build_parser().format_help().split())
        self.assertIn("gc-stale revert what a killed run left halfway, and overlays whose owner is gone",
                      usage)
        with open(os.path.join(HERE, "docs", "overlay_setup.md"), encoding="utf-8") as handle:
            self.assertIn("a crash is a crash, whoever the owner is", handle.read())

    @unittest.skipUnless(shutil.which("bash") and shutil.which("git"), "trace runs scripts with bash in a git tree")
    def test_a_compiled_name_that_is_no_file_is_as_the_reference_says(self):
        self.tree(tiny_files(build=Executable(TINY_BUILD.replace('"$here/tiny.c"',
                                                                 '"$here/tiny.c" "$here/gone.c"'))))
        subprocess.run(["git", "init", "-q"], cwd=self.root, check=True)
        subprocess.run(["git", "add", "-A"], cwd=self.root, check=True)
        rc, out, err = run_main(["--root", self.root, "trace", "--format", "json"])
        named = [i for r in json.loads(out)["results"] for i in r["issues"] if "gone.c" in i["message"]]
        with open(os.path.join(HERE, "docs", "check_contract.md"), encoding="utf-8") as handle:
            reference = " ".join(handle.read().split())
        says = "but for a name that is no file (the real compiler would fail on it): that name is not compared"
        self.assertEqual(says in reference, named == [],
                         "docs/check_contract.md (trace) must say what trace does with a compiled "
                         "name that is no file: %r, exit status %d" % (named, rc))

    def test_the_walkthrough_shows_some_of_each_output_in_order(self):
        self.assertTrue(readme_says("Lines starting with `#   ` show lines the command before them prints, "
                                    "in order, not all of them"))
        printed = "a\nb\nc\nd\ne\n"
        assert_shown(self, ["a", "c", "d", "e"], printed)  # some, in order
        with self.assertRaises(AssertionError):
            assert_shown(self, ["a", "c", "b", "e"], printed)  # out of order


class PreCommitHookTest(unittest.TestCase):
    """The hooks of .pre-commit-hooks.yaml as pre-commit itself runs them
    (installed from PyPI into a virtual environment once), from a clone of
    this repository, on a repository with one CPU backend."""

    @classmethod
    def setUpClass(cls):
        cls.tmp = tempfile.mkdtemp(prefix="pre-commit-")
        cls.venv, cls.skip_reason = venv_with(cls.tmp, "pre-commit")
        cls.hooks = os.path.join(cls.tmp, "hooks")
        copy_of_repository(cls.hooks)

    @classmethod
    def tearDownClass(cls):
        shutil.rmtree(cls.tmp, ignore_errors=True)

    def try_hook(self, hook, files):
        """(exit status, output) of `pre-commit try-repo` running `hook` (None:
        of `pre-commit run`, by the files' config) on a committed repository of `files`."""
        if self.skip_reason:
            self.skipTest(self.skip_reason)
        user = tempfile.mkdtemp(prefix="user-", dir=self.tmp)
        write_tree(user, files)
        git = ["git", "-c", "user.name=t", "-c", "user.email=t@example.com"]
        subprocess.run(git + ["init", "-q"], cwd=user, check=True)
        subprocess.run(git + ["add", "-A"], cwd=user, check=True)
        subprocess.run(git + ["commit", "-qm", "user"], cwd=user, check=True)
        command = ["try-repo", self.hooks, hook] if hook else ["run"]
        done = subprocess.run([os.path.join(self.venv, "bin", "pre-commit")] + command
                              + ["--all-files", "--verbose", "--color", "never"], cwd=user,
                              env=terminal_env(PRE_COMMIT_HOME=os.path.join(self.tmp, "cache")),
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, universal_newlines=True)
        return done.returncode, done.stdout

    def test_the_readmes_config_pinned_to_a_commit_runs_both_hooks(self):
        config = readme_yaml("- repo: ")
        self.assertIn("    rev: <commit>  #", config)  # no tag to name: the repository has none
        self.assertEqual(subprocess.run(["git", "tag"], cwd=HERE, stdout=subprocess.PIPE,
                                        universal_newlines=True).stdout, "")
        sha = subprocess.run(["git", "rev-parse", "HEAD"], cwd=self.hooks, stdout=subprocess.PIPE,
                             universal_newlines=True, check=True).stdout.strip()
        config = config.replace("https://github.com/<owner>/kernel-contract", self.hooks).replace("<commit>", sha)
        rc, out = self.try_hook(None, dict(tiny_files(), **{".pre-commit-config.yaml": config}))
        self.assertEqual(rc, 0, out)
        self.assertRegex(out, r"check backend contracts\.+Passed\n")
        self.assertRegex(out, r"trace backend build scripts\.+Passed\n")

    def test_the_hooks_are_check_and_trace(self):
        with open(os.path.join(HERE, ".pre-commit-hooks.yaml"), encoding="utf-8") as f:
            self.assertEqual(re.findall(r"^- id: (\S+)$", f.read(), re.M), ["check-contract", "trace-contract"])

    def test_the_check_hook_passes_a_true_manifest_and_fails_a_false_one(self):
        rc, out = self.try_hook("check-contract", tiny_files())
        self.assertEqual(rc, 0, out)
        self.assertIn("1 backend(s), 0 error(s), 0 warning(s)\n", out)
        broken = tiny_files()
        broken["backends/cpu/tiny/tiny.backend.json"]["abi_version"] = 3
        rc, out = self.try_hook("check-contract", broken)
        self.assertEqual(rc, 1, out)
        self.assertIn("[error] A001 cpu/tiny: abi_version is 3", out)

    def test_the_trace_hook_runs_the_build_scripts(self):
        rc, out = self.try_hook("trace-contract", tiny_files())
        self.assertEqual(rc, 0, out)
        self.assertIn("==> trace cpu/tiny: ./backends/cpu/tiny/build.sh <output-dir>\n", out)
        self.assertIn("1 backend(s) passed, 0 failed, 0 skipped\n", out)
        drifted = tiny_files(build=Executable(TINY_BUILD.replace("libtiny.so", "$(echo libother).so")))
        rc, out = self.try_hook("trace-contract", drifted)
        self.assertEqual(rc, 1, out)
        self.assertIn("[error] B004 cpu/tiny: running build.sh <output-dir> shows: build script build.sh "
                      "writes \"libother.so\" but build.output is \"libtiny.so\"\n", out)


def subcommands(parser):
    """{name: parser} of an argparse parser's subcommands."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


class ConventionsTest(unittest.TestCase):
    """Both tools speak alike: flags, formats, usage errors, exit statuses."""

    # (module, the prefix of its usage errors, the commands that print a report)
    TOOLS = ((check_contract, "check_contract.py: error: ",
              ("check", "list", "build", "test", "parity")),
             (overlay_setup, "overlay_setup: E100 ", ("env", "status")))

    def setUp(self):
        self.tmp = tempfile.mkdtemp(prefix="conventions-")
        self.addCleanup(shutil.rmtree, self.tmp, True)

    def call(self, tool, *argv):
        out, err = io.StringIO(), io.StringIO()
        saved = dict(os.environ)
        os.environ.pop("GITHUB_ACTIONS", None)
        os.environ["OVERLAY_STATE"] = os.path.join(self.tmp, "state")
        try:
            with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
                rc = tool.main(["--root" if tool is check_contract else "--state",
                                self.tmp if tool is check_contract else os.path.join(self.tmp, "state")]
                               + list(argv))
        finally:
            os.environ.clear()
            os.environ.update(saved)
        return rc, out.getvalue(), err.getvalue()

    def test_either_tool_run_as_a_module_answers_as_its_script_does(self):
        # `python3 -m TOOL` is the way to have its bytecode cached (docs); where
        # the cache cannot be written (an unwritable prefix) it still runs.
        env = dict(os.environ, XDG_STATE_HOME=os.path.join(self.tmp, "xdg"), PYTHONPATH=HERE)
        env.pop("PYTHONDONTWRITEBYTECODE", None)
        env.pop("GITHUB_ACTIONS", None)
        state = os.path.join(self.tmp, "state")
        calls = (("check_contract", "--root", self.tmp), ("check_contract", "--root", self.tmp, "list"),
                 ("check_contract", "--bogus"), ("overlay_setup", "--state", state, "status"),
                 ("overlay_setup", "--state", state, "revert"), ("overlay_setup", "--bogus"))
        for tool, *argv in calls:
            script = subprocess.run([sys.executable, os.path.join(HERE, tool + ".py")] + argv,
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
            for prefix in (os.path.join(self.tmp, "pycache"), "/proc/self/no-cache-here"):
                with self.subTest(tool=tool, argv=argv, prefix=prefix):
                    module = subprocess.run([sys.executable, "-X", "pycache_prefix=" + prefix, "-m",
                                             tool] + argv, stdout=subprocess.PIPE,
                                            stderr=subprocess.PIPE, env=env, cwd=self.tmp)
                    self.assertEqual((module.returncode, module.stdout, module.stderr),
                                     (script.returncode, script.stdout, script.stderr))
        self.assertTrue(os.listdir(os.path.join(self.tmp, "pycache")))

    def test_every_argument_has_help_with_its_default_and_every_command_an_example(self):
        for tool, _, _ in self.TOOLS:
            commands = subcommands(tool.build_parser())
            self.assertGreaterEqual(len(commands), 6)
            for name, parser in commands.items():
                with self.subTest(tool=tool.__name__, command=name):
                    self.assertRegex(parser.format_help(), r"\nexamples?:\n  ")
                    for action in parser._actions:
                        if isinstance(action, argparse._HelpAction):
                            continue
                        if action.help == argparse.SUPPRESS:
                            self.assertEqual(action.option_strings, ["--repo-root"])
                            continue
                        self.assertTrue(action.help, action.option_strings or action.metavar)
                        needs_default = (action.nargs in ("*", "?") or (
                            action.option_strings and action.default not in (
                                None, False, [], argparse.SUPPRESS)))
                        if needs_default:
                            self.assertIn("default", action.help, action.option_strings
                                          or action.metavar)

    def test_version_and_every_help_name_the_tool_and_show_an_example_in_both_tools(self):
        for tool, prog, example in (
                (check_contract, "check_contract.py", r"\nexamples:\n  python3 check_contract\.py "),
                (overlay_setup, "overlay_setup.py", r"\nexamples?:\n  (.*\n)*.*overlay_setup\.py ")):
            self.assertEqual(self.call(tool, "--version"), (0, "%s %s\n" % (prog, tool.VERSION), ""))
            for name in [None] + sorted(subcommands(tool.build_parser())):
                with self.subTest(tool=prog, command=name):
                    rc, out, err = self.call(tool, *([name] if name else []), "--help")
                    self.assertEqual((rc, err), (0, ""))
                    self.assertRegex(out, example)

    def test_every_command_with_json_takes_format_too(self):
        for tool, _, _ in self.TOOLS:
            for name, parser in subcommands(tool.build_parser()).items():
                options = {o for action in parser._actions for o in action.option_strings}
                with self.subTest(tool=tool.__name__, command=name):
                    self.assertEqual("--json" in options, "--format" in options)

    def test_parity_says_what_it_runs_by_default(self):
        help_text = " ".join(subcommands(check_contract.build_parser())["parity"].format_help().split())
        self.assertIn("NAME backends to run (default: the validated ones)", help_text)

    def test_the_root_flag_is_root_in_both_tools(self):
        check_help = check_contract.build_parser().format_help()
        self.assertIn("--root DIR", check_help)
        self.assertNotIn("--repo-root", check_help)
        commands = subcommands(overlay_setup.build_parser())
        for name in ("apply", "gc-stale"):
            self.assertIn("--root DIR", commands[name].format_help())
        write_tree(self.tmp, demo_files())
        by_root = run_main(["--root", self.tmp, "list"])
        self.assertEqual(by_root[0], 0)
        self.assertEqual(run_main(["--repo-root", self.tmp, "list"]), by_root)  # the old spelling
        self.assertEqual(run_main(["list", "--repo-root=" + self.tmp]), by_root)

    def test_format_json_and_its_json_alias_in_both_tools(self):
        write_tree(self.tmp, demo_files())
        self.assertEqual(self.call(overlay_setup, "init")[0], 0)
        for tool, prefix, commands in self.TOOLS:
            for name in commands:
                with self.subTest(tool=tool.__name__, command=name):
                    parser = subcommands(tool.build_parser())[name]
                    self.assertIn("--format", parser.format_help())
                    self.assertEqual(parser.parse_args(["--json"]).json, True)
                    rc, out, err = self.call(tool, name, "--json", "--format", "text")
                    self.assertEqual((rc, out, err), (
                        2, "", prefix + "--json and --format text ask "
                        "for two formats; give one\n"))
            for name in [c for c in commands if c in ("check", "list", "env", "status")]:
                with self.subTest(tool=tool.__name__, command=name):
                    as_json = self.call(tool, name, "--format", "json")
                    self.assertEqual(as_json[0], 0, as_json)
                    json.loads(as_json[1])
                    self.assertEqual(self.call(tool, name, "--json"), as_json)

    def test_a_usage_error_is_one_line_naming_the_help_to_read(self):
        for tool, prefix, _ in self.TOOLS:
            prog = "check_contract.py" if tool is check_contract else "overlay_setup.py"
            for name in subcommands(tool.build_parser()):
                with self.subTest(tool=tool.__name__, command=name):
                    rc, out, err = self.call(tool, name, "--no-such-flag")
                    self.assertEqual((rc, out), (2, ""))
                    self.assertEqual(err.count("\n"), 1, err)
                    self.assertNotIn("usage:", err)
                    self.assertTrue(err.startswith(prefix), err)
                    self.assertTrue(err.endswith("; see %s %s --help\n" % (prog, name)), err)

    def test_a_missing_input_exits_2_in_both_tools(self):
        missing = os.path.join(self.tmp, "missing")
        write_tree(self.tmp, demo_files())
        rc, out, err = self.call(check_contract, "init", missing)
        self.assertEqual((rc, out), (2, ""))
        self.assertTrue(err.startswith("check_contract.py: error: init %s" % missing), err)
        rc, out, err = self.call(overlay_setup, "add-python", "pkg.mod", missing)
        self.assertEqual((rc, out), (2, ""))
        self.assertTrue(err.startswith("overlay_setup: E102 cannot read %s" % missing), err)
        rc, out, err = self.call(overlay_setup, "apply", missing + ".diff", "--no-build")
        self.assertEqual((rc, out), (2, ""))
        self.assertTrue(err.startswith("overlay_setup: E102 cannot read patch %s.diff" % missing),
                        err)

    def interrupt(self, argv, cwd):
        """Start a tool, SIGINT it once its child printed `started`: (rc, stderr)."""
        proc = subprocess.Popen([sys.executable] + argv, cwd=cwd, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, universal_newlines=True)
        try:
            for line in proc.stdout:
                if "started" in line:
                    break
            else:
                self.fail("the build never printed 'started' (exit status %s): %s"
                          % (proc.wait(), proc.stderr.read()))
            proc.send_signal(signal.SIGINT)
            _, err = proc.communicate(timeout=60)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        return proc.returncode, err

    def test_ctrl_c_exits_130_in_both_tools(self):
        files = demo_files()
        files["backends/cpu/demo/build.sh"] = Executable(
            "#!/usr/bin/env bash\necho started\nsleep 30\nmkdir -p \"$1\"\n"
            'cc -shared -fPIC -march=${2:-x86-64} -o "$1/libdemo.so" ops.c\n')
        write_tree(self.tmp, files)
        rc, err = self.interrupt([CHECKER, "--root", self.tmp, "build", "--out",
                                  os.path.join(self.tmp, "out")], self.tmp)
        self.assertEqual(rc, 130, err)
        self.assertIn("check_contract.py: interrupted", err)
        source = os.path.join(self.tmp, "kernel.c")
        write_tree(self.tmp, {"kernel.c": "int k(void) { return 1; }\n",
                              "fast.c": "int k(void) { return 2; }\n"})
        rc, err = self.interrupt([os.path.join(HERE, "overlay_setup.py"), "--state",
                                  os.path.join(self.tmp, "state"), "add-native", "--source",
                                  source, "--patched", os.path.join(self.tmp, "fast.c"),
                                  "--build-cmd", "echo started; sleep 30",
                                  "--build-cwd", os.path.join(self.tmp, "backends")],
                                 self.tmp)
        self.assertEqual(rc, 130, err)
        self.assertIn("overlay_setup: interrupted", err)
        revert = subprocess.run([sys.executable, os.path.join(HERE, "overlay_setup.py"), "--state",
                                 os.path.join(self.tmp, "state"), "revert"], cwd=self.tmp,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                universal_newlines=True)
        self.assertEqual(revert.returncode, 0, revert.stdout)
        with open(source) as handle:
            self.assertEqual(handle.read(), "int k(void) { return 1; }\n")



def emitted_codes(path, code_re):
    """The codes a script can emit: those in its string literals, docstrings left out."""
    with open(path, encoding="utf-8") as f:
        tree = ast.parse(f.read())
    docstrings = {id(node.body[0].value) for node in ast.walk(tree)
                  if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef))
                  and ast.get_docstring(node, clean=False) is not None}
    codes = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) \
                and id(node) not in docstrings:
            codes.update(re.findall(code_re, node.value))
    return codes, set(re.findall(code_re, ast.get_docstring(tree)))


class CodesTest(unittest.TestCase):
    """Each tool's codes are listed, once each, in its docstring and in its
    reference, and nowhere a code the tool cannot emit."""

    def check_codes(self, tool, code_re):
        emitted, in_docstring = emitted_codes(os.path.join(HERE, tool + ".py"), r"\b%s\b" % code_re)
        with open(os.path.join(HERE, "docs", tool + ".md"), encoding="utf-8") as f:
            rows = re.findall(r"^\| (%s) \|" % code_re, f.read(), re.M)
        self.assertGreater(len(emitted), 25)
        self.assertEqual(sorted(in_docstring), sorted(emitted), "the docstring of %s.py" % tool)
        self.assertEqual(sorted(rows), sorted(emitted), "the table of docs/%s.md" % tool)

    def test_check_contract_codes_agree(self):
        self.check_codes("check_contract", "[DJMSABTORUPX][0-9]{3}")

    def test_overlay_setup_codes_agree(self):
        self.check_codes("overlay_setup", "E[0-9]{3}")

    def test_check_contract_levels_agree(self):
        """The level the reference's table and the docstring give each code
        is the one the checker prints it at: [error], or [warning]."""
        code_re = "[DJMSABTORUPX][0-9]{3}"
        with open(os.path.join(HERE, "docs", "check_contract.md"), encoding="utf-8") as f:
            rows = re.findall(r"^\| (%s) \| ([^|]+) \|" % code_re, f.read(), re.M)
        names = {"E": "error", "W": "warning"}
        in_table = {code: {names[word] for word in re.findall(r"\b[EW]\b", level)}
                    for code, level in rows}
        docstring = check_contract.__doc__
        parts = re.split(r"\b(%s)\b" % code_re, docstring[docstring.index("Diagnostic codes"):])
        in_docstring = {}
        for code, text in zip(parts[1::2], parts[2::2]):  # "B017 the reader cannot tell (warning)"
            text = " ".join(text.split())
            in_docstring.setdefault(code, {"error", "warning"} if "when" in text else
                                    {"warning"} if "(warning" in text else {"error"})
        printed = emitted_levels(CHECKER, code_re)
        self.assertGreater(len(printed), 50)
        for code, levels in sorted(printed.items()):
            for where, documented in (("docs", in_table[code]), ("docstring", in_docstring[code])):
                with self.subTest(code=code, where=where):
                    if len(documented) == 1:
                        self.assertEqual(levels, documented)
                    else:  # "W (E when validated)": the level is worked out when it is reported
                        self.assertLessEqual(levels, documented)


def reader_claims():
    """What the table "What the script reader reads" of docs/check_contract.md
    says the build-script reader follows (every row but one), and what its
    row read as "not followed" says it does not."""
    with open(os.path.join(HERE, "docs", "check_contract.md"), encoding="utf-8") as f:
        text = f.read()
    section = text[text.index("## What the script reader reads"):]
    section = section[:section.index("\n## ", 1)]
    rows = [line for line in section.splitlines() if line.startswith("| `")]
    return (" ".join(r for r in rows if "| not followed" not in r),
            " ".join(r.split(" | ")[0] for r in rows if "| not followed" in r))


class ReaderClaimsTest(unittest.TestCase):
    """What the docs' table says the build-script reader follows, it
    follows; what it says the reader does not follow, the reader says so."""

    # The construct as the table names it: a script using it, building sm_80 and sm_90.
    FOLLOWED = {
        "`case` with": 'case "${2:-}" in\n  "") a=80 ;;\n  *) a=$2 ;;\nesac\n'
                       'nvcc -shared -arch=sm_$a -gencode arch=compute_90,code=sm_90 k.cu -o "$1/l.so"\n',
        "`for v in words`": 'for a in 80 90; do nvcc -c -arch=sm_$a k.cu -o "$1/k$a.o"; done\n'
                            'nvcc -shared "$1"/k*.o -o "$1/l.so"\n',
        "`f() { ...; }`": 'build() { local arch=$1; nvcc -shared -arch=sm_$arch k.cu -o "$2/l.so"; }\n'
                          'build 80 "$1"\nbuild 90 "$1"\n',
        "`while`/`until`": 'until false; do\n  nvcc -shared -gencode arch=compute_80,code=sm_80 '
                           '-gencode arch=compute_90,code=sm_90 k.cu -o "$1/l.so"\n  break\ndone\n',
        "`pushd`": 'pushd "$1"\nnvcc -shared -arch=sm_80 k.cu -o a.so\npopd\n'
                   'nvcc -shared -arch=sm_90 k.cu -o "$1/l.so"\n',
        "`$(( expr ))`": 'a=$((40 * 2))\nnvcc -shared -arch=sm_$a -gencode arch=compute_$((a + 10)),'
                         'code=sm_$((a + 10)) k.cu -o "$1/l.so"\n',
        "`timeout`": 'timeout 600 nvcc -shared -gencode arch=compute_80,code=sm_80 '
                     '-gencode arch=compute_90,code=sm_90 k.cu -o "$1/l.so"\n',
    }

    def test_the_constructs_said_to_be_followed_are_followed(self):
        followed, not_followed = reader_claims()
        for claim, script in self.FOLLOWED.items():
            with self.subTest(claim=claim):
                self.assertNotIn(claim, not_followed)
                self.assertIn(claim, followed)
                facts = check_contract.ScriptReader(script).facts()
                self.assertEqual(facts.unfollowed, [])
                self.assertEqual(sorted({a for call in facts.calls for a in call.targets("cuda")}),
                                 ["80", "90"])

    def test_a_trap_command_is_said_not_to_be_followed_except_on_exit(self):
        self.assertIn("`trap ... ERR`", reader_claims()[1])
        facts = check_contract.ScriptReader("trap 'nvcc -shared -arch=sm_80 k.cu -o \"$1/l.so\"' "
                                            "ERR\n").facts()
        self.assertEqual(facts.calls, [])
        self.assertNotEqual(facts.unfollowed, [])
        facts = check_contract.ScriptReader("trap 'nvcc -shared -arch=sm_80 k.cu -o \"$1/l.so\"' "
                                            "EXIT\n").facts()
        self.assertEqual((len(facts.calls), facts.unfollowed), (1, []))

    def test_what_is_said_not_to_be_followed_is_reported(self):
        spans = re.findall(r"`([^`]+)`", reader_claims()[1])
        self.assertGreaterEqual(len(spans), 8, spans)
        for span in spans:
            if span == "trap":  # its command, tested above
                continue
            with self.subTest(span=span):
                facts = check_contract.ScriptReader(span + " x\n").facts()
                self.assertNotEqual(facts.unfollowed, [], span)


def emitted_levels(path, code_re):
    """{code: levels} of the findings a script reports where the call names
    both: backend.error("A001", ...), warning(...), Diagnostic("error",
    "R009", ...), report("warning", "X001", ...)."""
    with open(path, encoding="utf-8") as f:
        tree = ast.parse(f.read())
    levels = {}
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        name = getattr(node.func, "attr", getattr(node.func, "id", None))
        words = [a.value if isinstance(a, ast.Constant) and isinstance(a.value, str) else None
                 for a in node.args]
        for index, word in enumerate(words):
            if word is None or not re.match(code_re + r"\Z", word):
                continue
            if index == 0 and name in ("error", "warning"):
                levels.setdefault(word, set()).add(name)
            elif index > 0 and words[index - 1] in ("error", "warning"):
                levels.setdefault(word, set()).add(words[index - 1])
    return levels


class PythonVersionTest(unittest.TestCase):
    @unittest.skipUnless(shutil.which("vermin"), "vermin is not installed (pip install vermin)")
    def test_both_scripts_need_nothing_newer_than_python_3_9_0(self):
        # -t=3.9- : every line must run on 3.9 (3.9.0 included: a backport to a
        # later 3.9.x release counts as 3.10+ or newer in vermin's tables).
        proc = subprocess.run(["vermin", "-t=3.9-", "--no-tips", "--violations", CHECKER,
                               os.path.join(HERE, "overlay_setup.py")],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              universal_newlines=True)
        self.assertEqual(proc.returncode, 0, proc.stdout)


if __name__ == "__main__":
    unittest.main()
