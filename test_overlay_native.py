"""Tests for overlay_setup.py with real tools: gcc, make, git, ctypes, real
processes killed with real signals, and a real second filesystem (/dev/shm)
for tar snapshots.  No GPU needed."""

from __future__ import annotations

import argparse
import atexit
import contextlib
import difflib
import functools
import hashlib
import io
import json
import os
import pwd
import random
import re
import shutil
import signal
import stat
import subprocess
import sys
import tarfile
import tempfile
import time
import traceback
import unittest
import unittest.mock

HERE = os.path.dirname(os.path.abspath(__file__))
TOOL = os.path.join(HERE, "overlay_setup.py")
sys.path.insert(0, HERE)
import overlay_setup  # noqa: E402
import test_check_contract  # noqa: E402  (its readers of the docs' shell blocks)

# The tests that send SIGINT expect what a terminal gives: a run started in the
# background by a non-interactive shell (nohup CMD &) inherits SIGINT ignored,
# and so would every tool these tests start.
if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)

KERNELS = {
    "kernels.h": "double kernel_a(void);\ndouble kernel_b(void);\ndouble kernel_c(void);\n"
                 "double run_b(void);\n",
    "kernel_a.c": '#include "kernels.h"\ndouble kernel_a(void) { return 1.0; }\n',
    "kernel_b.c": '#include "kernels.h"\ndouble kernel_b(void)\n{\n    return 4.0;\n}\n',
    "kernel_c.c": '#include "kernels.h"\ndouble kernel_c(void) { return 9.0; }\n',
    "api.c": '#include "kernels.h"\ndouble run_b(void) { return kernel_b(); }\n',
    "Makefile": (
        "CFLAGS = -O1 -fPIC\n"
        "OBJS = kernel_a.o kernel_b.o kernel_c.o api.o\n"
        "libkernels.so: $(OBJS)\n"
        "\t$(CC) -shared -o $@ $(OBJS)\n"
        "\tmkdir -p cache && echo linked > cache/last-link\n"
        "%.o: %.c kernels.h\n"
        "\t$(CC) $(CFLAGS) -c -o $@ $<\n"),
    "cache/old-entry": "cached\n",
    "pkg/__init__.py": "",
    "pkg/mathops.py": "def scale():\n    return 2\n",
    "pkg/other.py": "def scale():\n    return 5\n",
}

CALL_B = ("import ctypes, sys; lib = ctypes.CDLL(sys.argv[1]); "
          "lib.run_b.restype = ctypes.c_double; print(lib.run_b())")
# What runs a probe that needs only the standard library: no site start-up.
PROBE_PYTHON = "%s -S" % sys.executable


# The probes import modules from the project tree, whose bytecode cache would
# otherwise show up in the byte-exact comparison of that tree after a revert.
NO_BYTECODE = dict(os.environ, PYTHONDONTWRITEBYTECODE="1")


def write_tree(root: str, files: dict) -> None:
    for relative, content in files.items():
        path = os.path.join(root, relative)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w", encoding="utf-8") as handle:
            handle.write(content)


def read_text(path: str) -> str:
    with open(path, encoding="utf-8") as handle:
        return handle.read()


def read_json(path: str) -> dict:
    return json.loads(read_text(path))


def write_text_file(path: str, text: str) -> None:
    with open(path, "w", encoding="utf-8") as handle:
        handle.write(text)


def write_json(path: str, value: dict) -> None:
    with open(path, "w", encoding="utf-8") as handle:
        json.dump(value, handle)


def tree_state(root: str) -> dict:
    """path -> (type, content hash, mode, mtime_ns, symlink target) for every entry."""
    found = {}
    for directory, dirs, files in os.walk(root):
        for name in dirs + files:
            path = os.path.join(directory, name)
            st = os.lstat(path)
            relative = os.path.relpath(path, root)
            if stat.S_ISLNK(st.st_mode):
                found[relative] = ("link", None, None, st.st_mtime_ns, os.readlink(path))
            elif stat.S_ISDIR(st.st_mode):
                found[relative] = ("dir", None, stat.S_IMODE(st.st_mode), st.st_mtime_ns, None)
            elif not stat.S_ISREG(st.st_mode):  # a fifo would block a read
                found[relative] = ("special", None, stat.S_IMODE(st.st_mode), st.st_mtime_ns, None)
            else:
                with open(path, "rb") as handle:
                    digest = hashlib.sha256(handle.read()).hexdigest()
                found[relative] = ("file", digest, stat.S_IMODE(st.st_mode), st.st_mtime_ns, None)
    return found


def shown(path: str) -> str:
    """A path as the tool shows it: relative to the current directory where it lies under it."""
    here = os.getcwd()
    return os.path.relpath(path, here) if path.startswith(here + "/") else path


def checked(*directories: str) -> str:
    """The line revert ends its list with: the directories it checked."""
    return ("checked %s; a build's writes outside %s (an install step into a prefix) are not, "
            "unless named with --build-dir or --artifact\n"
            % (", ".join(map(shown, directories)), "it" if len(directories) == 1 else "them"))


def call(*argv: str) -> tuple:
    """Run main() in-process and return (rc, stdout, stderr)."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = overlay_setup.main(list(argv))
    return rc, out.getvalue(), err.getvalue()


def run_tool(args: list, env: dict = None, cwd: str = None, own: bool = False):
    """Run the tool as a real process; with `own` it is its own owner, so it is
    a dead owner once it exits or is killed."""
    full_env = dict(os.environ)
    full_env.pop("OVERLAY_STATE", None)
    full_env.update(env or {})
    if own:
        command = ["sh", "-c", 'exec "$0" "$@" --owner-pid $$', sys.executable, TOOL] + args
    else:
        command = [sys.executable, TOOL] + args
    return subprocess.run(command, env=full_env, cwd=cwd, stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, universal_newlines=True)


# The registry of applied overlays lives under $XDG_STATE_HOME: never the real
# home's during the tests (each test case gets its own below).
_REGISTRY_HOME = tempfile.mkdtemp(prefix="overlay-test-xdg-")
os.environ["XDG_STATE_HOME"] = _REGISTRY_HOME


@atexit.register
def _remove_registry_home(pid: int = os.getpid()) -> None:
    if os.getpid() == pid:  # not in a fork of the test process
        shutil.rmtree(_REGISTRY_HOME, True)


def registry_entries() -> list:
    directory = overlay_setup.registry_dir()
    if not os.path.isdir(directory):
        return []
    return sorted(read_json(os.path.join(directory, name))["state"]
                  for name in os.listdir(directory))


def on_python_path(test: unittest.TestCase, directory: str) -> None:
    """Put `directory` on PYTHONPATH for the rest of the test: apply asks the
    interpreter under which name it imports each .py file of a patch, and a
    directory only the current directory would make importable does not count."""
    previous = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = directory
    if previous is None:
        test.addCleanup(os.environ.pop, "PYTHONPATH", None)
    else:
        test.addCleanup(os.environ.__setitem__, "PYTHONPATH", previous)


class OverlayTestCase(unittest.TestCase):
    def setUp(self) -> None:
        self.tmp = tempfile.mkdtemp(prefix="overlay-test-")
        self.addCleanup(shutil.rmtree, self.tmp, True)
        os.environ["XDG_STATE_HOME"] = os.path.join(self.tmp, "xdg-state")
        self.addCleanup(os.environ.__setitem__, "XDG_STATE_HOME", _REGISTRY_HOME)
        self.state = os.path.join(self.tmp, "state")
        self.old_cwd = os.getcwd()
        os.chdir(self.tmp)
        self.addCleanup(os.chdir, self.old_cwd)

    def tool(self, *argv: str) -> tuple:
        return call("--state", self.state, *argv)

    def assertOk(self, result: tuple) -> tuple:
        self.assertEqual(result[0], 0, result)
        return result

    def built_project(self, files: dict) -> str:
        """`files` written to tmp/proj and built by make a while ago
        (age_tree): the project a test patches."""
        return self.built_copy(os.path.join(self.tmp, "proj"), files, ["make"], aged=True)

    def built_copy(self, directory: str, files: dict, build: list, aged: bool = False) -> str:
        """`directory`: `files` as the command `build` leaves them built there
        (and aged by age_tree).  The tree is built once for the test class and
        copied for each test, mtimes kept (copy2), so that its tests do not
        compile the same sources again."""
        trees = type(self).__dict__.get("built_trees")
        if trees is None:
            trees = type(self).built_trees = {}
        key = (json.dumps(files, sort_keys=True), tuple(build), aged)
        if key not in trees:
            base = tempfile.mkdtemp(prefix="overlay-built-")
            type(self).addClassCleanup(shutil.rmtree, base, True)
            trees[key] = os.path.join(base, "tree")
            write_tree(trees[key], files)
            quiet(build, trees[key]).check_returncode()
            if aged:
                age_tree(trees[key])
        shutil.copytree(trees[key], directory, symlinks=True)
        return directory

    def kill_during_build(self, args: list) -> None:
        """Run the tool (its own owner, in a fork: see forked_tool) and SIGKILL
        it once its build command runs (a process of the build's group other
        than the shell that waits to start it).  The build is given 0.3 s more
        (TEST_BUILD_DELAY, see MAKE_PROJECT) for the kill to land in."""
        with open(os.devnull, "w") as devnull:
            tool = fork_tool(["--state", self.state] + args, {"TEST_BUILD_DELAY": "0.3"}, True,
                             devnull.fileno(), devnull.fileno())
        journal = os.path.join(self.state, "journal.json")
        deadline = time.monotonic() + 60
        building = False
        while not building and time.monotonic() < deadline:
            done, status = os.waitpid(tool, os.WNOHANG)
            if done:
                self.fail("the run ended (exit status %d) before its build was seen running"
                          % os.waitstatus_to_exitcode(status))
            try:
                entries = read_json(journal)["entries"]
            except (OSError, ValueError):
                entries = []
            process = entries and (entries[-1].get("build") or {}).get("process")
            building = bool(process) and build_command_runs(process["pid"])
            if not building:
                time.sleep(0.005)
        os.kill(tool, signal.SIGKILL)
        status = os.waitstatus_to_exitcode(os.waitpid(tool, 0)[1])
        self.assertTrue(building, "no build was seen running within a minute")
        self.assertEqual(status, -9, "the build finished before the kill")


class CProjectTest(OverlayTestCase):
    """A real C project: several .c files, a Makefile, objects, a shared library."""

    def setUp(self) -> None:
        super().setUp()
        self.proj = self.built_copy(os.path.join(self.tmp, "proj"), KERNELS, ["make", "-j2"])
        self.lib = os.path.join(self.proj, "libkernels.so")
        self.patched = os.path.join(self.tmp, "kernel_b_fast.c")
        write_tree(self.tmp, {"kernel_b_fast.c": KERNELS["kernel_b.c"].replace("4.0", "7.0")})
        time.sleep(0.01)

    def make(self, *extra: str) -> subprocess.CompletedProcess:
        return subprocess.run(["make", "-j2", "-C", self.proj] + list(extra),
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              universal_newlines=True)

    def output(self) -> str:
        return subprocess.run([sys.executable, "-S", "-c", CALL_B, self.lib], stdout=subprocess.PIPE,
                              universal_newlines=True, check=True).stdout.strip()

    def p(self, relative: str) -> str:
        return os.path.join(self.proj, relative)

    def add_kernel_b(self, *extra: str) -> tuple:
        return self.tool("add-native", "--source", self.p("kernel_b.c"), "--patched", self.patched,
                         "--artifact", self.p("kernel_b.o"), "--artifact", self.lib,
                         "--invalidate-cache", self.p("cache"),
                         "--build-cmd", "make -j2", "--build-cwd", self.proj, *extra)

    def test_patched_kernel_is_rebuilt_alone_and_revert_restores_the_tree(self) -> None:
        before = tree_state(self.proj)
        self.assertEqual(self.output(), "4.0")
        rc, out, err = self.add_kernel_b()
        self.assertEqual((rc, err), (0, ""))
        self.assertIn("cc -O1 -fPIC -c -o kernel_b.o kernel_b.c", out)
        self.assertNotIn("kernel_a.c", out)
        self.assertNotIn("kernel_c.c", out)
        self.assertNotIn("api.c", out)
        after = tree_state(self.proj)
        for unchanged in ("kernel_a.o", "kernel_c.o", "api.o", "kernel_a.c", "Makefile"):
            self.assertEqual(after[unchanged], before[unchanged], unchanged)
        self.assertNotEqual(after["kernel_b.o"], before["kernel_b.o"])
        self.assertNotIn("cache/old-entry", after)
        self.assertEqual(self.output(), "7.0")
        self.assertEqual(self.tool("verify-native"),
                         (0, "2 artifact(s) rebuilt from the patched sources\n", ""))

        rc, out, err = self.tool("revert")
        self.assertEqual((rc, err), (0, ""))
        self.assertEqual(out, "entry 1 restored: %s\n%sreverted %s\n"
                         % (shown(self.p("kernel_b.c")), checked(self.proj), self.state))
        self.assertEqual(tree_state(self.proj), before)
        self.assertEqual(self.make("-q").returncode, 0)
        self.assertEqual(self.output(), "4.0")

    def test_verify_native_reads_no_artifact_unwritten_since_the_build(self) -> None:
        self.assertOk(self.add_kernel_b())
        hashed = []
        file_sha256 = overlay_setup.file_sha256

        def spy(path: str):  # the tool's own hash, with the paths it reads noted
            hashed.append(os.path.realpath(path))
            return file_sha256(path)

        overlay_setup.file_sha256 = spy
        try:
            verified = self.tool("verify-native")
            with open(self.lib, "ab") as handle:  # written after the build: read again
                handle.write(b"\0")
            rewritten = self.tool("verify-native")
        finally:
            overlay_setup.file_sha256 = file_sha256
        self.assertEqual(verified, (0, "2 artifact(s) rebuilt from the patched sources\n", ""))
        self.assertEqual(rewritten, (1, "", "overlay_setup: E403 artifact %s changed after the "
                                     "build finished\n" % self.lib))
        self.assertEqual(hashed.count(os.path.realpath(self.lib)), 1)
        self.assertNotIn(os.path.realpath(self.p("kernel_b.o")), hashed)
        self.assertOk(self.tool("revert", "--force"))

    def test_two_entries_sharing_an_artifact_are_reverted_in_reverse_order(self) -> None:
        before = tree_state(self.proj)
        self.assertOk(self.add_kernel_b())
        write_tree(self.tmp, {"kernel_a_fast.c": KERNELS["kernel_a.c"].replace("1.0", "1.5")})
        self.assertOk(self.tool("add-native", "--source", self.p("kernel_a.c"), "--patched",
                                os.path.join(self.tmp, "kernel_a_fast.c"),
                                "--artifact", self.p("kernel_a.o"), "--artifact", self.lib,
                                "--invalidate-cache", self.p("cache"),
                                "--build-cmd", "make -j2", "--build-cwd", self.proj))
        self.assertEqual(self.tool("verify-native"),
                         (0, "3 artifact(s) rebuilt from the patched sources\n", ""))
        rc, out, err = self.tool("revert")
        self.assertEqual((rc, err), (0, ""))
        self.assertEqual(out, "entry 2 restored: %s\nentry 1 restored: %s\n%sreverted %s\n"
                         % (shown(self.p("kernel_a.c")), shown(self.p("kernel_b.c")), checked(self.proj),
                            self.state))
        self.assertEqual(tree_state(self.proj), before)
        self.assertEqual(self.make("-q").returncode, 0)

    def test_silent_noop_build_fails_at_once_and_stays_applied(self) -> None:
        rc, out, err = self.tool("add-native", "--source", self.p("kernel_b.c"), "--patched",
                                 self.patched, "--artifact", self.lib, "--build-cmd", "true",
                                 "--build-cwd", self.proj)
        self.assertEqual(rc, 1)
        self.assertRegex(err, r"^overlay_setup: E404 the build finished in \d+\.\ds but changed "
                              r"no --artifact \(%s\): the patch is not in them; it stays applied "
                              r"for inspection: if the build skipped it \(a compile error that "
                              r"the build script let pass\), fix the patch or the source and run "
                              r"`overlay_setup.py --state %s update`; else check --build-cmd, "
                              r"--build-cwd and --invalidate-cache, then run `overlay_setup.py "
                              r"--state %s revert`\n$"
                         % (re.escape(self.lib), re.escape(self.state), re.escape(self.state)))
        self.assertIn("7.0", read_text(self.p("kernel_b.c")))
        self.assertIn("entry 1: applied, but its build changed no artifact (exited 0 after",
                      self.tool("status")[1])
        self.assertEqual(self.tool("verify-native"), (
            1, "", "overlay_setup: E403 entry 1 is build-changed-nothing, not built: fix the "
            "patch or the source, then run `overlay_setup.py --state %s update`, or run "
            "`overlay_setup.py --state %s revert`\n" % (self.state, self.state)))
        self.assertOk(self.tool("revert"))

    def test_library_moved_aside_and_linked_back_is_no_rebuild(self) -> None:
        before = tree_state(self.proj)
        rc, out, err = self.tool("add-native", "--source", self.p("kernel_b.c"), "--patched",
                                 self.patched, "--artifact", self.lib, "--build-cmd",
                                 "mv libkernels.so old.so && ln -s old.so libkernels.so",
                                 "--build-cwd", self.proj)
        self.assertEqual(rc, 1)
        self.assertIn("overlay_setup: E404 the build finished in", err)
        self.assertEqual(self.tool("verify-native"), (
            1, "", "overlay_setup: E403 entry 1 is build-changed-nothing, not built: fix the "
            "patch or the source, then run `overlay_setup.py --state %s update`, or run "
            "`overlay_setup.py --state %s revert`\n" % (self.state, self.state)))
        self.assertEqual(self.tool("revert")[0], 0)
        self.assertEqual(tree_state(self.proj), before)

    def test_verify_native_with_nothing_built_fails(self) -> None:
        self.assertEqual(self.tool("verify-native"), (
            1, "", "overlay_setup: E207 no overlay at %s; `apply` or `add-native` first\n"
            % self.state))
        self.assertOk(self.tool("init"))
        self.assertEqual(self.tool("verify-native"), (
            1, "", "overlay_setup: E207 nothing is applied at %s; `apply` or `add-native` first\n"
            % self.state))

    def test_artifact_created_by_the_build_is_removed_by_revert(self) -> None:
        before = tree_state(self.proj)
        extra = self.p("libextra.so")
        self.assertOk(self.tool("add-native", "--source", self.p("kernel_b.c"), "--patched",
                                self.patched, "--artifact", extra,
                                "--build-cmd", "cp libkernels.so libextra.so",
                                "--build-cwd", self.proj))
        self.assertTrue(os.path.isfile(extra))
        self.assertEqual(self.tool("verify-native")[0], 0)
        self.assertOk(self.tool("revert"))
        self.assertFalse(os.path.exists(extra))
        self.assertEqual(tree_state(self.proj), before)

    def test_double_revert_and_revert_without_state_are_noops(self) -> None:
        self.assertEqual(self.tool("revert"), (0, "nothing to revert: no overlay at %s\n"
                                               % self.state, ""))
        self.assertOk(self.add_kernel_b())
        self.assertOk(self.tool("revert"))
        self.assertEqual(self.tool("revert"), (0, "nothing to revert at %s\n" % self.state, ""))

    def test_revert_without_a_build(self) -> None:
        before = tree_state(self.proj)
        self.assertOk(self.tool("add-native", "--source", self.p("kernel_b.c"),
                                "--patched", self.patched, "--no-build"))
        with open(self.p("kernel_b.c")) as handle:
            self.assertIn("7.0", handle.read())
        self.assertEqual(self.make("-q").returncode, 1)
        self.assertOk(self.tool("revert"))
        self.assertEqual(tree_state(self.proj), before)
        self.assertEqual(self.make("-q").returncode, 0)

    def test_failed_build_exits_1_and_stays_applied_for_revert(self) -> None:
        before = tree_state(self.proj)
        write_tree(self.tmp, {"broken.c": "double kernel_b(void) { return }\n"})
        rc, out, err = self.tool("add-native", "--source", self.p("kernel_b.c"), "--patched",
                                 os.path.join(self.tmp, "broken.c"), "--artifact", self.lib,
                                 "--build-cmd", "make", "--build-cwd", self.proj)
        self.assertEqual(rc, 1)
        self.assertRegex(err, r"^overlay_setup: E401 the build command exited with status 2 after "
                              r"\d+\.\ds; the patch stays applied for inspection: fix the patch "
                              r"or the source, then run `overlay_setup.py --state %s update`, or "
                              r"run `overlay_setup.py --state %s revert`\n$"
                         % (re.escape(self.state), re.escape(self.state)))
        rc, out, _ = self.tool("status")
        self.assertIn("entry 1: applied, but its build failed with status 2 after", out)
        self.assertIn("next: fix the patch or the source, then `overlay_setup.py --state %s "
                      "update`, or `overlay_setup.py --state %s revert`" % (self.state, self.state),
                      out)
        self.assertOk(self.tool("revert"))
        self.assertEqual(tree_state(self.proj), before)

    def test_build_timeout_kills_the_build(self) -> None:
        rc, out, err = self.tool("add-native", "--source", self.p("kernel_b.c"), "--patched",
                                 self.patched, "--build-cmd", "sleep 30", "--timeout", "0.5",
                                 "--build-cwd", self.proj)
        self.assertEqual(rc, 1)
        self.assertRegex(err, r"^overlay_setup: E402 the build command timed out after 0\.\ds and "
                              r"was killed; the patch stays applied: run `overlay_setup.py "
                              r"--state %s update --timeout SECONDS` to build again with more "
                              r"time, or `overlay_setup.py --state %s revert`\n$"
                         % (re.escape(self.state), re.escape(self.state)))
        self.assertOk(self.tool("revert"))

    def test_untracked_build_products_are_named_and_removed(self) -> None:
        os.unlink(self.p("api.o"))
        before = tree_state(self.proj)
        rc, out, err = self.add_kernel_b()
        self.assertEqual(rc, 0)
        self.assertEqual(err, "warning: the build created files that no --artifact or "
                              "--invalidate-cache covers (revert removes them): %s\n"
                         % self.p("api.o"))
        self.assertIn("untracked build product %s" % self.p("api.o"), self.tool("status")[1])
        self.assertOk(self.tool("revert"))
        self.assertEqual(tree_state(self.proj), before)

    def test_keep_untracked_keeps_build_products(self) -> None:
        os.unlink(self.p("api.o"))
        self.assertOk(self.add_kernel_b())
        self.assertOk(self.tool("revert", "--keep-untracked"))
        self.assertTrue(os.path.isfile(self.p("api.o")))

    def test_source_changed_after_apply_is_refused_without_force(self) -> None:
        self.assertOk(self.tool("add-native", "--source", self.p("kernel_b.c"),
                                "--patched", self.patched, "--no-build"))
        with open(self.p("kernel_b.c"), "a") as handle:
            handle.write("/* edited */\n")
        self.assertEqual(self.tool("revert"), (
            1, "", "overlay_setup: E501 %s was changed after the overlay was applied (neither the "
            "original nor the patched content); nothing was reverted: if another overlay patched "
            "it since, revert that one first; else run `overlay_setup.py --state %s revert "
            "--force` to restore the original anyway\n" % (self.p("kernel_b.c"), self.state)))
        self.assertOk(self.tool("revert", "--force"))
        self.assertEqual(read_text(self.p("kernel_b.c")), KERNELS["kernel_b.c"])

    def test_symlink_planted_at_the_source_is_replaced_not_followed(self) -> None:
        before = tree_state(self.proj)
        victim = os.path.join(self.tmp, "victim.txt")
        write_tree(self.tmp, {"victim.txt": "precious\n"})
        self.assertOk(self.tool("add-native", "--source", self.p("kernel_b.c"),
                                "--patched", self.patched, "--no-build"))
        os.unlink(self.p("kernel_b.c"))
        os.symlink(victim, self.p("kernel_b.c"))
        self.assertEqual(self.tool("revert"), (
            1, "", "overlay_setup: E501 %s was changed after the overlay was applied (neither the "
            "original nor the patched content); nothing was reverted: if another overlay patched "
            "it since, revert that one first; else run `overlay_setup.py --state %s revert "
            "--force` to restore the original anyway\n" % (self.p("kernel_b.c"), self.state)))
        self.assertOk(self.tool("revert", "--force"))
        self.assertEqual(read_text(victim), "precious\n")
        self.assertFalse(os.path.islink(self.p("kernel_b.c")))
        self.assertEqual(tree_state(self.proj), before)

    def test_source_already_overlaid_is_refused(self) -> None:
        self.assertOk(self.tool("add-native", "--source", self.p("kernel_b.c"),
                                "--patched", self.patched, "--no-build"))
        self.assertEqual(self.tool("add-native", "--source", self.p("kernel_b.c"),
                                   "--patched", self.patched, "--no-build"), (
            1, "", "overlay_setup: E103 source %s is already overlaid; run `overlay_setup.py "
            "--state %s revert` first\n" % (self.p("kernel_b.c"), self.state)))

    def test_relative_paths_are_resolved_against_the_cwd_and_recorded_absolute(self) -> None:
        os.chdir(self.proj)
        self.assertOk(self.tool("add-native", "--source", "kernel_b.c", "--patched",
                                "../kernel_b_fast.c", "--artifact", "./libkernels.so",
                                "--invalidate-cache", "cache", "--build-cmd", "make",
                                "--build-cwd", "."))
        entry = read_json(os.path.join(self.state, "journal.json"))["entries"][0]
        self.assertEqual([r["path"] for r in entry["sources"] + entry["artifacts"]],
                         [self.p("kernel_b.c"), self.lib])
        self.assertEqual((entry["caches"][0]["path"], entry["build"]["cwd"]),
                         (self.p("cache"), self.proj))
        self.assertEqual(self.output(), "7.0")
        self.assertOk(self.tool("revert"))

    def test_a_path_with_dots_and_no_symlink_is_taken_as_its_normalised_form(self) -> None:
        self.assertOk(self.tool("add-native", "--source", "proj/../proj/kernel_b.c", "--patched",
                                self.patched, "--artifact", self.proj + "/./../proj/libkernels.so",
                                "--no-build"))
        entry = read_json(os.path.join(self.state, "journal.json"))["entries"][0]
        self.assertEqual([r["path"] for r in entry["sources"] + entry["artifacts"]],
                         [self.p("kernel_b.c"), self.lib])
        self.assertOk(self.tool("revert"))

    def test_a_path_going_up_from_a_symlink_or_a_missing_directory_is_refused(self) -> None:
        os.mkdir(os.path.join(self.tmp, "elsewhere"))
        os.symlink(os.path.join(self.tmp, "elsewhere"), os.path.join(self.proj, "link"))
        self.assertEqual(self.tool("add-native", "--source", "proj/link/../kernel_b.c",
                                   "--patched", self.patched, "--no-build"), (
            2, "", "overlay_setup: E101 --source 'proj/link/../kernel_b.c' goes up ('..') from "
            "%s/link, which is or lies under a symbolic link, so its normalised form may name "
            "another file; pass the path without '..', e.g. %s/kernel_b.c\n" % (self.proj, self.tmp)))
        self.assertEqual(self.tool("add-native", "--source", self.p("kernel_b.c"), "--patched",
                                   self.patched, "--artifact", "proj/none/../libkernels.so",
                                   "--no-build"), (
            2, "", "overlay_setup: E101 --artifact 'proj/none/../libkernels.so' goes up ('..') "
            "from %s/none, which is no directory, so its normalised form may name another file; "
            "pass the path without '..', e.g. %s\n" % (self.proj, self.lib)))
        self.assertFalse(os.path.exists(self.state))

    def test_build_command_or_no_build_is_required(self) -> None:
        self.assertEqual(self.tool("add-native", "--source", self.p("kernel_b.c"),
                                   "--patched", self.patched), (
            2, "", "overlay_setup: E109 pass --build-cmd CMD (the install's own build) or "
            "--no-build; --dry-run lists the build systems found near the source\n"))

    def test_unreadable_patched_file_and_missing_source_are_refused(self) -> None:
        self.assertEqual(self.tool("add-native", "--source", self.p("kernel_b.c"),
                                   "--patched", "/nonexistent.c", "--no-build"), (
            2, "", "overlay_setup: E102 cannot read --patched /nonexistent.c (No such file or "
            "directory); pass the patched file\n"))
        self.assertEqual(self.tool("add-native", "--source", self.p("nope.c"),
                                   "--patched", self.patched, "--no-build"), (
            2, "", "overlay_setup: E102 --source %s does not exist; pass the installed file to "
            "patch (or use `apply` with a patch that creates it)\n" % self.p("nope.c")))
        self.assertFalse(os.path.exists(self.state))

    def test_another_owner_is_refused(self) -> None:
        self.assertOk(self.tool("add-native", "--source", self.p("kernel_b.c"),
                                "--patched", self.patched, "--no-build"))
        other = subprocess.Popen(["sleep", "60"])  # an owner that is surely not the default one
        self.addCleanup(other.wait)
        self.addCleanup(other.kill)
        rc, out, err = self.tool("add-native", "--source", self.p("kernel_a.c"), "--patched",
                                 self.patched, "--no-build", "--owner-pid", str(other.pid))
        self.assertEqual(rc, 1)
        owner = overlay_setup.default_owner()
        self.assertEqual(err, "overlay_setup: E205 this overlay belongs to pid %d on %s (live); "
                              "pass --owner-pid %d to add to it, or run `overlay_setup.py "
                              "--state %s revert` first\n"
                         % (owner, overlay_setup.host_name(), owner, self.state))
        self.assertOk(self.tool("add-native", "--source", self.p("kernel_a.c"), "--patched",
                                self.patched, "--no-build", "--owner-pid", str(owner)))
        self.assertOk(self.tool("revert"))

    def test_e205_for_a_gone_owner_offers_only_what_works(self) -> None:
        short = subprocess.Popen(["sleep", "30"])
        self.assertOk(self.tool("add-native", "--source", self.p("kernel_b.c"),
                                "--patched", self.patched, "--no-build", "--owner-pid",
                                str(short.pid)))
        short.kill()
        short.wait()
        self.assertEqual(self.tool("add-native", "--source", self.p("kernel_a.c"), "--patched",
                                   self.patched, "--no-build"), (
            1, "", "overlay_setup: E205 this overlay belongs to pid %d on %s (gone); its owner "
            "is gone: run `overlay_setup.py --state %s revert` first\n"
            % (short.pid, overlay_setup.host_name(), self.state)))
        self.assertOk(self.tool("revert"))
        self.assertOk(self.tool("add-native", "--source", self.p("kernel_a.c"), "--patched",
                                self.patched, "--no-build"))
        self.assertOk(self.tool("revert"))

    def test_dead_owner_pid_is_a_usage_error(self) -> None:
        dead = subprocess.Popen(["true"])
        dead.wait()
        for command in (["init"], ["add-python", "m", self.patched],
                        ["add-native", "--source", self.p("kernel_a.c"), "--patched",
                         self.patched, "--no-build"]):
            with self.subTest(command=command[0]):
                self.assertEqual(self.tool(*command, "--owner-pid", str(dead.pid)), (
                    2, "", "overlay_setup: E108 --owner-pid %d is not a running process; pass the "
                    "pid of the process that owns this overlay\n" % dead.pid))
                self.assertFalse(os.path.exists(self.state), "refused, yet the state was made")

    def test_state_option_is_accepted_after_the_subcommand_and_from_the_environment(self) -> None:
        self.assertOk(call("init", "--state", self.state))
        self.assertTrue(os.path.isfile(os.path.join(self.state, "journal.json")))
        other = os.path.join(self.tmp, "other-state")
        os.environ["OVERLAY_STATE"] = other
        try:
            self.assertOk(call("init"))
        finally:
            del os.environ["OVERLAY_STATE"]
        self.assertTrue(os.path.isdir(other))
        self.assertOk(call("init"))
        self.assertTrue(os.path.isdir(overlay_setup.default_state_dir(self.tmp)))

    def test_newer_journal_format_is_refused(self) -> None:
        self.assertOk(self.tool("init"))
        path = os.path.join(self.state, "journal.json")
        journal = read_json(path)
        journal["format"] = overlay_setup.FORMAT_VERSION + 1
        write_json(path, journal)
        self.assertEqual(self.tool("revert"), (
            1, "", "overlay_setup: E201 journal %s has format 2, newer than this tool understands "
            "(1); use the overlay_setup.py that wrote it\n" % path))

    def test_tampered_journal_paths_are_refused_before_acting(self) -> None:
        self.assertOk(self.add_kernel_b())
        path = os.path.join(self.state, "journal.json")
        good = read_text(path)
        journal = json.loads(good)
        journal["entries"][0]["sources"][0]["backup"] = "../../etc/passwd"
        write_json(path, journal)
        self.assertEqual(self.tool("revert"), (
            1, "", "overlay_setup: E203 journal %s names backup '../../etc/passwd' outside the "
            "state directory; the journal was tampered with, nothing was changed\n" % path))
        journal = json.loads(good)
        journal["entries"][0]["artifacts"][0]["path"] = self.proj + "/../proj/x.o"
        write_json(path, journal)
        self.assertEqual(self.tool("revert"), (
            1, "", "overlay_setup: E203 journal %s names target %r that is not an absolute, "
            "normalised path; the journal was tampered with, nothing was changed\n"
            % (path, self.proj + "/../proj/x.o")))
        write_text_file(path, good)
        self.assertOk(self.tool("revert"))

    def test_journal_never_runs_a_command_on_revert(self) -> None:
        self.assertOk(self.add_kernel_b())
        path = os.path.join(self.state, "journal.json")
        journal = read_json(path)
        marker = os.path.join(self.tmp, "ran")
        journal["entries"][0]["build"]["cmd"] = "touch %s" % marker
        write_json(path, journal)
        self.assertOk(self.tool("revert"))
        self.assertFalse(os.path.exists(marker))

    def test_a_second_command_waits_for_the_lock_naming_its_holder(self) -> None:
        self.assertOk(self.tool("init"))
        state = overlay_setup.State(self.state)
        self.assertTrue(state.try_lock("test-holder"))
        try:
            waiter = subprocess.Popen([sys.executable, TOOL, "--state", self.state, "init",
                                       "--owner-pid", str(os.getpid())],
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                      universal_newlines=True)
            line = waiter.stderr.readline()
            self.assertRegex(line, r"^waiting for the lock on %s, held by pid %d on .* "
                                   r"\(test-holder since .*Z\)\n$" % (self.state, os.getpid()))
            self.assertIsNone(waiter.poll())
        finally:
            state.unlock()
        self.assertEqual(waiter.wait(10), 0)
        waiter.stdout.close()
        waiter.stderr.close()


    def test_state_is_named_and_found_from_another_directory(self) -> None:
        before = tree_state(self.proj)
        work = os.path.join(self.tmp, "work")
        default_state = overlay_setup.default_state_dir(work)
        os.mkdir(work)
        os.chdir(work)
        rc, out, err = call("add-native", "--source", "../proj/kernel_b.c", "--patched",
                            "../kernel_b_fast.c", "--artifact", "../proj/libkernels.so",
                            "--artifact", "../proj/kernel_b.o", "--invalidate-cache",
                            "../proj/cache", "--build-cmd", "make", "--build-cwd", "../proj")
        self.assertEqual((rc, err), (0, ""), out)
        self.assertIn("state: %s\n" % default_state, out)
        self.assertEqual(overlay_setup.registered_states(), [default_state])
        self.assertEqual(registry_entries(), [], "the state home's listing is its record")
        os.chdir(self.tmp)
        here = overlay_setup.default_state_dir(self.tmp)
        self.assertEqual(call("status"), (
            0, "no overlay at %s\napplied overlays of this user:\n  %s: 1 native entry, 0 Python "
            "module(s), 0 rebind(s); owner %s\nnext: `overlay_setup.py --state %s status`, or "
            "`overlay_setup.py revert --all`\n"
            % (here, default_state,
               overlay_setup.describe_owner(read_json(os.path.join(
                   default_state, "journal.json"))["owner"]), default_state), ""))
        self.assertEqual(call("revert"), (
            1, "", "overlay_setup: E208 no overlay at %s, but this user has applied overlays at "
            "%s; run `overlay_setup.py --state %s revert`\n" % (here, default_state,
                                                                default_state)))
        self.assertEqual(self.output(), "7.0")
        self.assertEqual(call("revert", "--all"), (
            0, "entry 1 restored: %s\n%sreverted %s\n"
            % (shown(self.p("kernel_b.c")), checked(self.proj), default_state),
            ""))
        self.assertEqual(overlay_setup.registered_states(), [])
        self.assertEqual(tree_state(self.proj), before)
        self.assertEqual(call("revert"), (0, "nothing to revert: no overlay at %s\n" % here, ""))

    def test_revert_all_reverts_every_registered_state_and_refuses_state(self) -> None:
        before = tree_state(self.proj)
        self.assertOk(self.tool("add-native", "--source", self.p("kernel_b.c"), "--patched",
                                self.patched, "--no-build"))
        other = os.path.join(self.tmp, "other-state")
        self.assertOk(call("--state", other, "add-python", "pkg.mathops", self.patched))
        self.assertEqual(registry_entries(), sorted([self.state, other]))
        self.assertEqual(self.tool("revert", "--all"), (
            2, "", "overlay_setup: E109 --all reverts every applied overlay of this user; drop "
            "--state (or $OVERLAY_STATE), or drop --all\n"))
        rc, out, err = call("revert", "--all")
        self.assertEqual((rc, err), (0, ""))
        self.assertIn("reverted %s\n" % self.state, out)
        self.assertIn("reverted %s\n" % other, out)
        self.assertEqual(registry_entries(), [])
        self.assertEqual(tree_state(self.proj), before)

    def test_registry_is_written_before_the_install_changes_and_gc_stale_uses_it(self) -> None:
        before = tree_state(self.proj)
        refused = self.tool("add-native", "--source", self.p("kernel_b.c"), "--patched",
                            self.patched, "--artifact", self.p("kernel_b.c"), "--no-build")
        self.assertEqual(refused, (1, "", "overlay_setup: E106 %s is both the source and an "
                                          "--artifact; drop the --artifact\n" % self.p("kernel_b.c")))
        self.assertEqual(registry_entries(), [], "a refused command leaves no registry record")
        for point in range(1, 40):
            killed = forked_tool(["--state", self.state, "add-native", "--source",
                                  self.p("kernel_b.c"), "--patched", self.patched, "--no-build"],
                                 {"OVERLAY_TEST_KILL_AT": str(point)}, own=True)
            if killed.returncode == 0:
                break
            self.assertEqual(killed.returncode, -9, killed)
            if tree_state(self.proj) != before:
                self.assertEqual(registry_entries(), [self.state], "killed at %d" % point)
            elsewhere = os.path.join(self.tmp, "elsewhere")
            os.makedirs(elsewhere, exist_ok=True)
            result = call("gc-stale", "--root", elsewhere)
            self.assertEqual(result[0], 0, result)
            self.assertEqual(registry_entries(), [])
            shutil.rmtree(self.state, True)
            self.assertEqual(tree_state(self.proj), before)
        self.assertGreater(point, 3)
        self.assertEqual(registry_entries(), [self.state])
        self.assertEqual(call("gc-stale", "--root", self.proj)[0], 0)
        self.assertEqual(tree_state(self.proj), before)

    def add_kernel_a(self, state: str, *extra: str) -> tuple:
        write_tree(self.tmp, {"kernel_a_fast.c": KERNELS["kernel_a.c"].replace("1.0", "1.5")})
        return call("--state", state, "add-native", "--source", self.p("kernel_a.c"),
                    "--patched", os.path.join(self.tmp, "kernel_a_fast.c"),
                    "--build-cmd", "make", "--build-cwd", self.proj, *extra)

    def test_a_path_held_by_another_applied_state_is_refused(self) -> None:
        self.assertOk(self.add_kernel_b())
        before = tree_state(self.proj)
        other = os.path.join(self.tmp, "other-state")
        self.assertEqual(self.add_kernel_a(other, "--artifact", self.lib), (
            1, "", "overlay_setup: E120 --artifact %s is already held by the overlay at %s "
            "(entry 1, %s); nothing was changed: revert that one first (`overlay_setup.py "
            "--state %s revert`), or add this change to it with --state %s\n"
            % (self.lib, self.state, self.lib, self.state, self.state)))
        self.assertEqual(self.add_kernel_a(other, "--invalidate-cache", self.p("cache"))[2],
                         "overlay_setup: E120 --invalidate-cache %s is already held by the "
                         "overlay at %s (entry 1, %s); nothing was changed: revert that one "
                         "first (`overlay_setup.py --state %s revert`), or add this change to it "
                         "with --state %s\n" % (self.p("cache"), self.state, self.p("cache"),
                                                 self.state, self.state))
        self.assertEqual(tree_state(self.proj), before)
        self.assertEqual(registry_entries(), [self.state])
        self.assertOk(self.add_kernel_a(self.state, "--artifact", self.lib, "--artifact",
                                        self.p("kernel_a.o"), "--invalidate-cache",
                                        self.p("cache")))
        self.assertOk(self.tool("revert"))

    def test_artifact_or_cache_changed_after_the_build_is_not_reverted_over(self) -> None:
        before = tree_state(self.proj)
        self.assertOk(self.add_kernel_b())
        # Another overlay the registry does not know of (another $XDG_STATE_HOME)
        # sets the same cache aside and rebuilds the same library; the library's
        # claim refuses it as an --artifact, not as a product of its build.
        os.environ["XDG_STATE_HOME"] = os.path.join(self.tmp, "another-home")
        other = os.path.join(self.tmp, "other-state")
        self.assertIn("E124 --artifact %s is held by the overlay at %s" % (self.lib, self.state),
                      self.add_kernel_a(other, "--artifact", self.lib)[2])
        self.assertOk(self.add_kernel_a(other, "--artifact", self.p("kernel_a.o"),
                                        "--invalidate-cache", self.p("cache")))
        os.environ["XDG_STATE_HOME"] = os.path.join(self.tmp, "xdg-state")
        patched = tree_state(self.proj)
        message = ("overlay_setup: E509 %s was changed after the overlay's build (neither the "
                   "original nor what that build made): another overlay or build wrote it, and "
                   "restoring it now would undo that; nothing was reverted: revert the other one "
                   "first, or run `overlay_setup.py --state %s revert --force` to restore the "
                   "original anyway\n")
        self.assertEqual(self.tool("revert"), (1, "", message % (self.p("cache"), self.state)))
        self.assertEqual(tree_state(self.proj), patched)
        self.assertOk(call("--state", other, "revert"))
        with open(self.lib, "ab") as handle:
            handle.write(b"\0")
        self.assertEqual(self.tool("revert"), (1, "", message % (self.lib, self.state)))
        self.assertOk(self.tool("revert", "--force"))
        self.assertEqual(tree_state(self.proj), before)

    def test_an_artifact_rewritten_with_its_own_size_after_the_build_is_not_reverted_over(
            self) -> None:
        # revert hashes an artifact again only if it was written since the build's hash
        before = tree_state(self.proj)
        self.assertOk(self.add_kernel_b())
        with open(self.lib, "rb") as handle:
            first = handle.read(1)
        with open(self.lib, "r+b") as handle:
            handle.write(bytes([first[0] ^ 1]))
        rc, out, err = self.tool("revert")
        self.assertEqual((rc, out, err.split(" was changed")[0]),
                         (1, "", "overlay_setup: E509 %s" % self.lib))
        with open(self.lib, "r+b") as handle:  # written again, with what the build made
            handle.write(first)
        self.assertOk(self.tool("revert"))
        self.assertEqual(tree_state(self.proj), before)


    def test_state_inside_the_build_directory_or_a_cache_is_refused_before_anything(self) -> None:
        before = tree_state(self.proj)
        inside = self.p(".overlay")
        self.assertEqual(call("--state", inside, "add-native", "--source", self.p("kernel_b.c"),
                              "--patched", self.patched, "--build-cmd", "make",
                              "--build-cwd", self.proj), (
            1, "", "overlay_setup: E121 the state directory %s lies inside the build directory "
            "%s, where a clean step of the build (`make clean`, `git clean -xdf`) would delete "
            "the journal and the backups; nothing was changed: pass --state DIR outside it, or "
            "leave --state and $OVERLAY_STATE unset for the default, %s\n"
            % (inside, self.proj, overlay_setup.default_state_dir(self.tmp))))
        self.assertEqual(tree_state(self.proj), before)
        self.assertEqual(call("--state", self.p("cache/state"), "add-native", "--source",
                              self.p("kernel_b.c"), "--patched", self.patched,
                              "--invalidate-cache", self.p("cache"), "--no-build")[2],
                         "overlay_setup: E106 --invalidate-cache %s overlaps the state directory "
                         "%s; keep them apart\n" % (self.p("cache"), self.p("cache/state")))
        self.assertEqual(registry_entries(), [])

    @unittest.skipUnless(shutil.which("git"), "needs git")
    def test_a_build_that_cleans_the_state_away_is_reported_not_nothing_to_revert(self) -> None:
        git = ["git", "-c", "user.name=t", "-c", "user.email=t@example.com", "-C", self.tmp]
        os.environ["XDG_STATE_HOME"] = tempfile.mkdtemp(prefix="overlay-test-xdg-")
        self.addCleanup(shutil.rmtree, os.environ["XDG_STATE_HOME"], True)
        os.unlink(self.patched)
        subprocess.run(git + ["init", "-q"], check=True)
        subprocess.run(git + ["add", "proj"], check=True)
        subprocess.run(git + ["commit", "-qm", "install"], check=True)
        state = os.path.join(self.tmp, ".overlay")  # in the repository, as 1.0 made it by default
        write_tree(self.tmp, {"outside/fast.c": KERNELS["kernel_b.c"].replace("4.0", "7.0")})
        rc, out, err = call("add-native", "--source", self.p("kernel_b.c"), "--patched",
                            os.path.join(self.tmp, "outside/fast.c"), "--artifact", self.lib,
                            "--state", state,
                            "--build-cmd", "until grep -q process ../.overlay/journal.json; do "
                            "sleep 0.05; done; git clean -xdfq .. && make",
                            "--build-cwd", self.proj)
        record = overlay_setup.registry_record(state)
        self.assertEqual((rc, err), (1, "overlay_setup: E406 the build deleted the state "
                                        "directory %s (a clean step?): %s stays patched and the "
                                        "backups are lost; restore from version control or a "
                                        "reinstall, then delete %s\n"
                                        % (state, self.p("kernel_b.c"), record)), out)
        vanished = ("overlay_setup: E209 state directory %s is registered with an overlay "
                    "applied, but its journal is gone (deleted by a build's clean step, or by "
                    "hand): the install may still be patched and its backups are lost; restore "
                    "the patched files from version control or a reinstall, then delete %s\n"
                    % (state, record))
        self.assertEqual(call("revert"), (1, "", vanished))
        self.assertEqual(call("status"), (1, "", vanished))
        rc, out, err = call("gc-stale", "--root", self.proj)
        self.assertEqual((rc, out), (1, ""))
        self.assertTrue(err.endswith(vanished[len("overlay_setup: E209 "):]
                                     + "overlay_setup: 1 state directory refused or failed; see "
                                       "above\n"), err)
        subprocess.run(git + ["checkout", "-q", "proj"], check=True)
        os.unlink(record)
        self.assertEqual(call("revert"), (0, "nothing to revert: no overlay at %s\n"
                                          % overlay_setup.default_state_dir(self.tmp), ""))


    def test_update_rebuilds_in_place_and_one_revert_restores_the_original(self) -> None:
        before = tree_state(self.proj)
        write_tree(self.tmp, {"broken.c": "double kernel_b(void) { return }\n"})
        rc, out, err = self.add_kernel_b("--patched", os.path.join(self.tmp, "broken.c"))
        self.assertIn("E401", err)
        rc, out, err = self.tool("update", "--patched", self.patched)
        self.assertEqual((rc, err), (0, ""), out)
        self.assertIn("cc -O1 -fPIC -c -o kernel_b.o kernel_b.c", out)
        self.assertTrue(out.endswith("entry 1 updated: %s; the originals stay backed up for "
                                     "`overlay_setup.py --state %s revert`\n"
                                     % (shown(self.p("kernel_b.c")), self.state)), out)
        self.assertEqual(self.output(), "7.0")
        self.assertEqual(self.tool("verify-native")[0], 0)
        with open(self.p("kernel_b.c"), "w") as handle:  # fixed in place
            handle.write(KERNELS["kernel_b.c"].replace("4.0", "8.0"))
        self.assertOk(self.tool("update"))
        self.assertEqual(self.output(), "8.0")
        patch = os.path.join(self.tmp, "five.diff")
        write_text_file(patch, "--- a/kernel_b.c\n+++ b/kernel_b.c\n@@ -4 +4 @@\n"
                               "-    return 4.0;\n+    return 5.0;\n")
        self.assertOk(self.tool("update", patch, "--root", self.proj))
        self.assertEqual(self.output(), "5.0")
        self.assertIn("entry 1: built", self.tool("status")[1])
        rc, out, err = self.tool("revert")
        self.assertEqual((rc, err), (0, ""))
        self.assertEqual(tree_state(self.proj), before)
        self.assertEqual(self.make("-q").returncode, 0)
        self.assertEqual(self.output(), "4.0")


    def trial(self, *extra: str, **popen: object):
        patch = os.path.join(self.tmp, "seven.diff")
        write_text_file(patch, "--- a/kernel_b.c\n+++ b/kernel_b.c\n@@ -4 +4 @@\n"
                               "-    return 4.0;\n+    return 7.0;\n")
        args = [sys.executable, TOOL, "--state", self.state, "trial", patch, "--root", self.proj,
                "--artifact", self.lib, "--artifact", self.p("kernel_b.o"), "--invalidate-cache",
                self.p("cache"), "--build-cmd", "make", "--build-cwd", self.proj] + list(extra)
        return subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                universal_newlines=True, cwd=self.tmp, **popen)

    def test_trial_usage_shows_the_command_after_the_double_dash(self) -> None:
        rc, out, err = call("trial", "--help")
        self.assertEqual((rc, err), (0, ""))
        self.assertIn(" PATCH -- COMMAND [ARG...]\n", out)

    def test_trial_runs_reference_and_candidate_alternately_and_always_reverts(self) -> None:
        before = tree_state(self.proj)
        trial = self.trial("--repeat", "2", "--json", "--", sys.executable, "-S", "-c", CALL_B,
                           self.lib)
        out, err = trial.communicate(timeout=120)
        self.assertEqual(trial.returncode, 0, err)
        result = json.loads(out)
        self.assertEqual([(run["kind"], run["round"], run["exit"]) for run in result["runs"]],
                         [("reference", 1, 0), ("candidate", 1, 0), ("reference", 2, 0),
                          ("candidate", 2, 0)])
        self.assertEqual((result["verify"], result["revert"], result["failed_step"]),
                         ("2 artifact(s) rebuilt", {"reverted": True, "differences": [],
                                                    "left_alone": None}, None))
        self.assertEqual(re.findall(r"^(\d\.0)$", err, re.M), ["4.0", "7.0", "4.0", "7.0"])
        self.assertEqual(tree_state(self.proj), before)
        self.assertEqual(self.make("-q").returncode, 0)
        self.assertEqual(registry_entries(), [])

    def test_trial_names_the_failed_step_in_its_exit_status_and_reverts(self) -> None:
        before = tree_state(self.proj)
        check = "%s -c '%s' %s | grep -qx 4.0" % (PROBE_PYTHON, CALL_B, self.lib)
        trial = self.trial("--", "sh", "-c", check)
        out, err = trial.communicate(timeout=120)
        self.assertEqual(trial.returncode, 13, err)
        self.assertRegex(out, r"^trial of .*seven.diff \(state %s\):\n"
                              r"  watched: %s \(writes elsewhere, such as an install prefix, "
                              r"are not checked\)\n"
                              r"  reference run 1: exit 0 in \d+\.\d\ds\n"
                              r"  candidate run 1: exit 1 in \d+\.\d\ds\n"
                              r"  verify: 2 artifact\(s\) rebuilt\n"
                              r"  revert: the install is byte-identical to before\n"
                              r"result: candidate: the command failed on the patched install "
                              r"\(exit status 13\)\n$" % (re.escape(self.state),
                                                            re.escape(self.proj)))
        self.assertEqual(tree_state(self.proj), before)
        for extra, status in ((["--", "false"], 10),  # the reference run fails
                              (["--build-cmd", "true", "--", "true"], 11)):  # a no-op build
            trial = self.trial(*extra)
            out, err = trial.communicate(timeout=60)
            self.assertEqual((trial.returncode, tree_state(self.proj)), (status, before), out)

    def test_trial_stopped_by_sigterm_or_sigint_reverts_first(self) -> None:
        before = tree_state(self.proj)
        slow = "%s -c '%s' %s | grep -qx 4.0 || { echo the candidate waits >&2; exec sleep 30; }" % (
            PROBE_PYTHON, CALL_B, self.lib)
        for signum, status in ((signal.SIGTERM, 143), (signal.SIGINT, 130)):
            trial = self.trial("--", "sh", "-c", slow, start_new_session=True)
            for line in trial.stderr:
                if line == "the candidate waits\n":
                    break
            os.killpg(trial.pid, signum) if signum == signal.SIGINT else trial.send_signal(signum)
            out, err = trial.communicate(timeout=60)
            self.assertEqual(trial.returncode, status, err)
            self.assertIn("revert: the install is byte-identical to before\n", out)
            self.assertEqual(tree_state(self.proj), before)


class MadePackageTest(OverlayTestCase):
    """A package `pkg` whose one kernel k.c make builds into libk.so, and two
    patched versions of k.c beside it, named by PATCHED."""

    MAKEFILE = ("libk.so: k.o\n\t$(CC) -shared -o $@ k.o\n"
                "k.o: k.c\n\t$(CC) -O1 -fPIC -c -o $@ k.c\n")
    PATCHED = ("k_new.c", "k_newer.c")

    def setUp(self) -> None:
        super().setUp()
        self.pkg = self.built_copy(os.path.join(self.tmp, "pkg"), {
            "k.c": "double k(void) { return 1.0; }\n", "Makefile": self.MAKEFILE}, ["make", "-s"])
        write_tree(self.tmp, {self.PATCHED[0]: "double k(void) { return 2.0; }\n",
                              self.PATCHED[1]: "double k(void) { return 3.0; }\n"})
        self.before = tree_state(self.pkg)


class DefaultStateTest(MadePackageTest):
    """The first natural use: run from the install directory with no --state,
    every command finds the overlay; the state lives under $XDG_STATE_HOME."""

    def setUp(self) -> None:
        super().setUp()
        os.chdir(self.pkg)

    def add(self, *extra: str) -> tuple:
        return call("add-native", "--source", "k.c", "--patched", "../k_new.c",
                    "--artifact", "libk.so", "--build-cmd", "make", *extra)

    def test_every_command_run_from_the_install_directory_finds_its_overlay(self) -> None:
        state = overlay_setup.default_state_dir(self.pkg)
        self.assertTrue(state.startswith(os.path.join(self.tmp, "xdg-state", "overlay_setup",
                                                      "tmp-overlay-test-")), state)
        self.assertRegex(os.path.basename(state), r"-pkg-[0-9a-f]{8}$")
        rc, out, err = self.add()
        self.assertEqual((rc, err), (0, ""), out)
        self.assertIn("state: %s\n" % state, out)
        self.assertEqual(call("verify-native"),
                         (0, "1 artifact(s) rebuilt from the patched sources\n", ""))
        rc, out, err = call("update", "--patched", "../k_newer.c")
        self.assertEqual((rc, err), (0, ""), out)
        rc, out, err = call("status")
        self.assertEqual((rc, err), (0, ""))
        self.assertIn("state: %s\nowner: " % state, out)
        self.assertIn("entry 1: built", out)
        self.assertEqual(call("revert"), (0, "entry 1 restored: %s\n%sreverted %s\n"
                                          % (shown(os.path.join(self.pkg, "k.c")), checked(self.pkg),
                                             state), ""))
        self.assertEqual(tree_state(self.pkg), self.before)

    def test_from_elsewhere_status_lists_and_each_message_names_the_exact_command(self) -> None:
        self.assertOk(self.add())
        state = overlay_setup.default_state_dir(self.pkg)
        os.chdir(self.tmp)
        here = overlay_setup.default_state_dir(self.tmp)
        rc, out, err = call("status")
        self.assertEqual((rc, err), (0, ""))
        self.assertTrue(out.startswith("no overlay at %s\napplied overlays of this user:\n  %s: "
                                       "1 native entry" % (here, state)), out)
        self.assertTrue(out.endswith("next: `overlay_setup.py --state %s status`, or "
                                     "`overlay_setup.py revert --all`\n" % state), out)
        for command in ("update", "verify-native", "revert"):
            self.assertEqual(call(command), (
                1, "", "overlay_setup: E208 no overlay at %s, but this user has applied "
                "overlays at %s; run `overlay_setup.py --state %s %s`\n"
                % (here, state, state, command)))
        self.assertOk(call("--state", state, "revert"))
        self.assertEqual(tree_state(self.pkg), self.before)
        self.assertEqual(call("update"), (1, "", "overlay_setup: E207 no overlay at %s; `apply` "
                                          "or `add-native` first\n" % here))

    def test_from_a_directory_whose_own_overlay_was_reverted_revert_names_the_applied_one(
            self) -> None:
        # A state directory stays after its revert: finding it, revert must not
        # report a clean install while another default-state overlay is applied.
        os.chdir(self.tmp)
        write_tree(self.tmp, {"x.c": "int x;\n", "y.c": "int y;\n"})
        self.assertOk(call("add-native", "--source", "x.c", "--patched", "y.c", "--no-build"))
        self.assertOk(call("revert"))
        here = overlay_setup.default_state_dir(self.tmp)
        self.assertTrue(os.path.isdir(here))
        os.chdir(self.pkg)
        self.assertOk(self.add())
        state = overlay_setup.default_state_dir(self.pkg)
        os.chdir(self.tmp)
        for command in ("revert", "update", "verify-native"):
            self.assertEqual(call(command), (
                1, "", "overlay_setup: E208 no overlay at %s, but this user has applied "
                "overlays at %s; run `overlay_setup.py --state %s %s`\n"
                % (here, state, state, command)))
        self.assertOk(call("--state", state, "revert"))
        self.assertEqual(tree_state(self.pkg), self.before)
        self.assertEqual(call("revert"), (0, "nothing to revert at %s\n" % here, ""))

    def test_an_unset_or_relative_state_home_means_local_state_of_home(self) -> None:
        home = os.path.join(self.tmp, "home")
        for value in (None, "relative/state", ""):
            env = {"HOME": home}
            if value is not None:
                env["XDG_STATE_HOME"] = value
            with self.subTest(XDG_STATE_HOME=value):
                done = subprocess.run(
                    [sys.executable, "-c", "import overlay_setup; "
                     "print(overlay_setup.default_state_dir('/srv/pkg'))"],
                    env=dict({k: v for k, v in os.environ.items() if k != "XDG_STATE_HOME"},
                             PYTHONPATH=HERE, **env), stdout=subprocess.PIPE,
                    universal_newlines=True, check=True)
                self.assertRegex(done.stdout, r"^%s/srv-pkg-[0-9a-f]{8}\n$" % re.escape(
                    os.path.join(home, ".local", "state", "overlay_setup")))

    def test_an_unwritable_state_location_is_refused_before_anything_changes(self) -> None:
        blocked = os.path.join(self.tmp, "not-a-directory")
        write_text_file(blocked, "a file where the state home would go\n")
        os.environ["XDG_STATE_HOME"] = blocked
        home = os.path.join(blocked, "overlay_setup")
        rc, out, err = self.add()
        self.assertEqual((rc, out), (1, ""))
        self.assertEqual(err, "overlay_setup: E210 cannot write the state directory %s (Not a "
                              "directory); nothing was changed: pass --state DIR on a writable "
                              "filesystem, or set XDG_STATE_HOME to a writable directory for the "
                              "default (now %s)\n"
                         % (overlay_setup.default_state_dir(self.pkg), home))
        self.assertNotIn("E601", err)
        self.assertEqual(tree_state(self.pkg), self.before)

    def test_the_directory_of_make_minus_c_is_a_build_directory_too(self) -> None:
        work = os.path.join(self.tmp, "work")
        os.mkdir(work)
        os.chdir(work)
        inside = os.path.join(self.pkg, ".state")
        self.assertEqual(call("--state", inside, "add-native", "--source", "../pkg/k.c",
                              "--patched", "../k_new.c", "--build-cmd", "make -C ../pkg"), (
            1, "", "overlay_setup: E121 the state directory %s lies inside the build directory "
            "%s, where a clean step of the build (`make clean`, `git clean -xdf`) would delete "
            "the journal and the backups; nothing was changed: pass --state DIR outside it, or "
            "leave --state and $OVERLAY_STATE unset for the default, %s\n"
            % (inside, self.pkg, overlay_setup.default_state_dir(work))))
        self.assertEqual(tree_state(self.pkg), self.before)

    def test_the_readme_walkthrough_runs_the_overlay_with_no_state_option(self) -> None:
        # test_check_contract's RepositoryTest runs these blocks as written.
        with open(os.path.join(HERE, "README.md"), encoding="utf-8") as handle:
            readme = handle.read()
        blocks = re.findall(r"```sh\n(.*?)```", readme, re.S)
        overlay = [block for block in blocks if "overlay_setup.py" in block]
        self.assertGreaterEqual(len(overlay), 2)
        for block in overlay:
            self.assertNotIn("--state", block)
            self.assertNotIn("OVERLAY_STATE", block)

    def test_an_overlay_applied_by_version_1_0_in_dot_overlay_still_reverts(self) -> None:
        # Version 1.0 kept its state in ./.overlay (manifest.json) with a
        # record in $XDG_STATE_HOME/overlay_setup/applied; the journal format
        # is unchanged, so --state and the old file name make that layout.
        legacy = os.path.join(self.pkg, ".overlay")
        self.assertOk(call("--state", legacy, "add-native", "--source", "k.c", "--patched",
                           "../k_new.c", "--no-build"))
        os.rename(os.path.join(legacy, "journal.json"), os.path.join(legacy, "manifest.json"))
        self.assertEqual(registry_entries(), [legacy])
        rc, out, err = call("status")
        self.assertEqual((rc, err), (0, ""))
        self.assertIn("state: %s\n" % legacy, out)
        self.assertEqual(call("revert"), (0, "entry 1 restored: %s\n%sreverted %s\n"
                                          % (shown(os.path.join(self.pkg, "k.c")),
                                             checked(os.path.join(self.pkg, "k.c")), legacy), ""))
        self.assertEqual(registry_entries(), [])
        shutil.rmtree(legacy)
        self.assertEqual(tree_state(self.pkg), self.before)
        rc, out, err = self.add()  # the next apply uses the default state directory
        self.assertEqual((rc, err), (0, ""), out)
        self.assertIn("state: %s\n" % overlay_setup.default_state_dir(self.pkg), out)
        self.assertOk(call("revert"))


class CrashIsACrashTest(OverlayTestCase):
    """A run of the tool killed while it applied, built, updated or reverted
    leaves a stale entry whoever the owner is: gc-stale finishes it."""

    MAKEFILE = ("libk.so: k.o\n\t$(CC) -shared -o $@ k.o\n"
                "\tif grep -q slow k.c; then touch ../building; exec sleep 60; fi\n"
                "k.o: k.c\n\t$(CC) -O1 -fPIC -c -o $@ k.c\n")

    def setUp(self) -> None:
        super().setUp()
        self.pkg = self.built_copy(os.path.join(self.tmp, "pkg"), {
            "k.c": "double k(void) { return 1.0; }\n", "Makefile": self.MAKEFILE}, ["make", "-s"])
        write_tree(self.tmp, {"fast.c": "double k(void) { return 2.0; }\n",
                              "slow.c": "/* slow */ double k(void) { return 3.0; }\n"})
        self.marker = os.path.join(self.tmp, "building")
        self.before = tree_state(self.pkg)

    def start(self, *args: str) -> subprocess.Popen:
        """The tool as a real process with its default owner (the session
        leader, which stays alive), killed with SIGKILL once its build runs."""
        env = dict(os.environ)
        env.pop("OVERLAY_STATE", None)
        tool = subprocess.Popen([sys.executable, TOOL, "--state", self.state] + list(args),
                                env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 60
        while not os.path.exists(self.marker) and tool.poll() is None \
                and time.monotonic() < deadline:
            time.sleep(0.01)
        tool.kill()
        output = tool.communicate()[0].decode(errors="replace")
        self.assertEqual(tool.returncode, -9, "the build finished before the kill:\n" + output)
        os.unlink(self.marker)
        return tool

    def apply_args(self, patched: str) -> list:
        return ["add-native", "--source", os.path.join(self.pkg, "k.c"), "--patched", patched,
                "--artifact", os.path.join(self.pkg, "libk.so"), "--build-cmd", "make",
                "--build-cwd", self.pkg]

    def test_apply_killed_in_its_build_is_stale_although_its_owner_lives(self) -> None:
        self.start(*self.apply_args(os.path.join(self.tmp, "slow.c")))
        owner = read_json(os.path.join(self.state, "journal.json"))["owner"]
        self.assertEqual(overlay_setup.owner_liveness(owner), "live")
        self.assertEqual(call("gc-stale", "--root", self.tmp, "--dry-run"), (
            0, "stale: %s (owner %s; the run building entry 1 stopped halfway): would revert\n"
            % (self.state, overlay_setup.describe_owner(owner)), ""))
        rc, out, err = call("gc-stale", "--root", self.tmp)
        self.assertEqual((rc, out), (0, "stale: %s (owner %s; the run building entry 1 stopped "
                                        "halfway): reverted\n"
                                     % (self.state, overlay_setup.describe_owner(owner))), err)
        self.assertEqual(tree_state(self.pkg), self.before)

    def test_a_completed_overlay_of_a_live_owner_stays(self) -> None:
        self.assertOk(self.tool(*self.apply_args(os.path.join(self.tmp, "fast.c"))))
        patched = tree_state(self.pkg)
        rc, out, err = call("gc-stale", "--root", self.tmp)
        self.assertEqual((rc, err), (0, ""))
        self.assertTrue(out.startswith("live: %s (owner pid " % self.state), out)
        self.assertEqual(tree_state(self.pkg), patched)
        self.assertOk(self.tool("revert"))
        self.assertEqual(tree_state(self.pkg), self.before)

    def test_update_killed_in_its_build_reverts_without_e509(self) -> None:
        self.assertOk(self.tool(*self.apply_args(os.path.join(self.tmp, "fast.c"))))
        self.start("update", "--patched", os.path.join(self.tmp, "slow.c"))
        # k.o and the library are what the killed build wrote: no hash records that.
        self.assertEqual(call("--state", self.state, "status")[1].splitlines()[-1],
                         "next: `overlay_setup.py --state %s revert` (it stops a build left "
                         "running and restores everything)" % self.state)
        rc, out, err = self.tool("revert")
        self.assertEqual(rc, 0, err)
        self.assertRegex(err, r"^stopping the build that entry 1 left running \(process group "
                              r"\d+\)\n$")
        self.assertEqual(tree_state(self.pkg), self.before)

    def test_update_after_a_run_killed_in_its_build_is_refused_and_revert_moves_files_aside(
            self) -> None:
        # What appeared in the build directory after the killed run began its
        # build may be that build's or the user's; a new build would take it
        # for its own products, and revert then deleted a results file written
        # after the kill (and kept the patched k.o, E510, once an update was
        # the run killed).
        for first in (self.apply_args(os.path.join(self.tmp, "slow.c")),
                      ["update", "--patched", os.path.join(self.tmp, "slow.c")]):
            if first[0] == "update":
                self.assertOk(self.tool(*self.apply_args(os.path.join(self.tmp, "fast.c"))))
            self.start(*first)
            write_tree(self.pkg, {"results.txt": "mine\n"})
            journal = read_json(os.path.join(self.state, "journal.json"))
            rc, out, err = self.tool("update", "--patched", os.path.join(self.tmp, "fast.c"))
            self.assertEqual((rc, out, err), (1, "", (
                "overlay_setup: E211 entry 1's last run stopped before its build finished, so what "
                "appeared in %s since may be your own; a new build would take it for its "
                "products: run `overlay_setup.py --state %s revert` (it stops the build left "
                "running, moves those files aside and restores the rest), then apply again\n"
                % (self.pkg, self.state))))
            self.assertEqual(read_json(os.path.join(self.state, "journal.json")), journal)
            rc, out, err = self.tool("revert")
            self.assertEqual(rc, 0, err)
            self.assertEqual(tree_state(self.pkg), self.before)
            with open(os.path.join(self.state, "leftovers", "1", "results.txt")) as handle:
                self.assertEqual(handle.read(), "mine\n")
            shutil.rmtree(os.path.join(self.state, "leftovers"))

    def test_revert_killed_halfway_is_finished_by_gc_stale(self) -> None:
        self.assertOk(self.tool(*self.apply_args(os.path.join(self.tmp, "fast.c"))))
        self.assertOk(self.tool("add-native", "--source", os.path.join(self.pkg, "Makefile"),
                                "--patched", os.path.join(self.tmp, "fast.c"), "--no-build"))
        killed = forked_tool(["--state", self.state, "revert"], {"OVERLAY_TEST_KILL_AT": "3"})
        self.assertEqual(killed.returncode, -9, killed)
        self.assertNotEqual(tree_state(self.pkg), self.before)
        rc, out, err = call("gc-stale", "--root", self.tmp)
        self.assertEqual((rc, err), (0, ""))
        self.assertRegex(out, r"^stale: %s \(owner pid \d+ on \S+ \(live\); the run reverting "
                              r"stopped halfway\): reverted\n$" % re.escape(self.state))
        self.assertEqual(tree_state(self.pkg), self.before)


class OwnedFilesTest(MadePackageTest):
    """Revert restores or deletes a file only while it is exactly what the
    tool recorded after the build; a build product is deleted only if the
    tool's own build created it."""

    PATCHED = ("fast.c", "faster.c")

    def add(self, *extra: str, cwd_build: bool = True) -> tuple:
        return self.tool("add-native", "--source", os.path.join(self.pkg, "k.c"), "--patched",
                         os.path.join(self.tmp, "fast.c"), *(
                             ("--build-cmd", "make", "--build-cwd", self.pkg) if cwd_build
                             else ()), *extra)

    def test_a_scan_that_reaches_its_limit_is_refused_before_anything(self) -> None:
        self.addCleanup(setattr, overlay_setup, "SCAN_LIMIT", overlay_setup.SCAN_LIMIT)
        overlay_setup.SCAN_LIMIT = 20
        write_tree(self.pkg, {"data/%02d.txt" % number: "keep\n" for number in range(30)})
        before = tree_state(self.pkg)
        message = ("overlay_setup: E110 the build directory %s holds more than 20 entries, more "
                   "than the scan that tells the build's new files from yours records; nothing "
                   "was changed: pass --build-cwd (or make -C) at the folder the build writes "
                   "in, or --no-build and run the build yourself (revert then leaves what it "
                   "makes)\n" % self.pkg)
        self.assertEqual(self.add(), (1, "", message))
        self.assertEqual(self.add("--dry-run"), (1, "", message))
        self.assertEqual(tree_state(self.pkg), before)
        self.assertFalse(os.path.exists(os.path.join(self.state, "backups", "1")))
        self.assertOk(self.tool("add-native", "--source", os.path.join(self.pkg, "k.c"),
                                "--patched", os.path.join(self.tmp, "fast.c"), "--no-build"))
        self.assertOk(self.tool("revert"))
        self.assertEqual(tree_state(self.pkg), before)

    def test_make_minus_c_builds_in_its_directory_not_the_current_one(self) -> None:
        work = os.path.join(self.tmp, "work")
        os.mkdir(work)
        os.chdir(work)
        # The recipe stands for an optimizer writing its results beside the
        # build while the build runs: no product of the build in pkg.
        write_tree(self.pkg, {"Makefile": self.MAKEFILE.replace(
            "-o $@ k.o\n", "-o $@ k.o\n\techo 0.93 > ../work/results.txt\n")})
        subprocess.run(["make", "-s", "-C", self.pkg, "-B"], check=True,
                       stdout=subprocess.DEVNULL)
        os.unlink(os.path.join(work, "results.txt"))
        before = tree_state(self.pkg)
        rc, out, err = self.add("--build-cmd", "make -C ../pkg", cwd_build=False)
        self.assertEqual((rc, err), (0, ""), out)
        self.assertIn("backed up 2 build product(s) the build may rewrite: %s (predicted by "
                      "make -n -W), %s (predicted by make -n -W)"
                      % (os.path.join(self.pkg, "k.o"), os.path.join(self.pkg, "libk.so")), out)
        self.assertEqual(self.tool("revert"), (0, "entry 1 restored: %s\n%sreverted %s\n"
                                               % (shown(os.path.join(self.pkg, "k.c")), checked(self.pkg),
                                                  self.state), ""))
        self.assertEqual(tree_state(self.pkg), before)
        self.assertEqual(read_text(os.path.join(work, "results.txt")), "0.93\n")

    def test_files_written_after_the_build_survive_update_and_revert(self) -> None:
        self.assertOk(self.add())
        write_tree(self.pkg, {"results.txt": "0.93\n", "notes/run1.md": "fast\n"})
        rc, out, err = self.tool("update", "--patched", os.path.join(self.tmp, "faster.c"))
        self.assertEqual((rc, err), (0, ""), out)
        rc, out, err = self.tool("revert")
        self.assertEqual((rc, err), (0, ""), out)
        self.assertEqual(read_text(os.path.join(self.pkg, "results.txt")), "0.93\n")
        self.assertEqual(read_text(os.path.join(self.pkg, "notes/run1.md")), "fast\n")
        os.unlink(os.path.join(self.pkg, "results.txt"))
        shutil.rmtree(os.path.join(self.pkg, "notes"))
        after = tree_state(self.pkg)
        self.assertEqual({k: v for k, v in after.items() if k != "."},
                         {k: v for k, v in self.before.items() if k != "."})

    def test_a_tampered_product_of_an_earlier_build_is_refused_before_acting(self) -> None:
        self.assertOk(self.add())
        victim = os.path.join(self.tmp, "victim.txt")
        write_text_file(victim, "keep\n")
        path = os.path.join(self.state, "journal.json")
        journal = read_json(path)
        journal["entries"][0]["untracked"] = None  # as an update killed in its build leaves it
        journal["entries"][0]["earlier_untracked"] = [
            {"path": victim, "kind": "f", "created": True}]
        write_json(path, journal)
        rc, out, err = self.tool("revert")
        self.assertEqual((rc, out), (1, ""))
        self.assertEqual(err, "overlay_setup: E203 journal %s names build product %r outside "
                              "the build directory %s; nothing was changed\n"
                         % (path, victim, self.pkg))
        self.assertEqual(read_text(victim), "keep\n")

    def test_update_of_one_entry_does_not_take_another_entrys_products(self) -> None:
        write_tree(self.pkg, {"m.c": "int m;\n"})
        before = tree_state(self.pkg)
        self.assertOk(self.add())
        write_tree(self.tmp, {"m_new.c": "int m = 2;\n"})
        self.assertOk(self.tool("add-native", "--source", os.path.join(self.pkg, "m.c"),
                                "--patched", os.path.join(self.tmp, "m_new.c"), "--build-cmd",
                                "cc -c -o m.o m.c", "--build-cwd", self.pkg))
        self.assertOk(self.tool("update", "--entry", "1", "--patched",
                                os.path.join(self.tmp, "faster.c")))
        journal = read_json(os.path.join(self.state, "journal.json"))
        first = [product["path"] for product in journal["entries"][0]["untracked"]]
        self.assertNotIn(os.path.join(self.pkg, "m.o"), first)
        self.assertEqual([product["path"] for product in journal["entries"][1]["untracked"]],
                         [os.path.join(self.pkg, "m.o")])
        self.assertOk(self.tool("revert"))
        self.assertEqual(tree_state(self.pkg), before)

    def test_a_library_upgraded_while_applied_is_kept_and_named(self) -> None:
        self.assertOk(self.add())
        library = os.path.join(self.pkg, "libk.so")
        os.unlink(library)
        write_text_file(library, "version 2 of the package\n")  # an upgrade replaced it
        rc, out, err = self.tool("revert")
        self.assertEqual((rc, out), (3, "entry 1 restored: %s\n%sreverted %s\n"
                                     % (shown(os.path.join(self.pkg, "k.c")), checked(self.pkg),
                                        self.state)))
        self.assertEqual(err, "overlay_setup: E510 kept %s: changed after the overlay's build "
                              "(not what the build left, nor the original), so it is not the "
                              "overlay's to restore or remove; run `overlay_setup.py --state %s "
                              "revert --force` to restore or remove it all the same\n"
                         % (library, self.state))
        self.assertEqual(read_text(library), "version 2 of the package\n")
        self.assertEqual(read_text(os.path.join(self.pkg, "k.c")),
                         "double k(void) { return 1.0; }\n")

    def test_force_restores_what_changed_after_the_build(self) -> None:
        self.assertOk(self.add())
        with open(os.path.join(self.pkg, "k.o"), "ab") as handle:
            handle.write(b"\0")
        self.assertOk(self.tool("revert", "--force"))
        self.assertEqual(tree_state(self.pkg), self.before)

    def test_a_link_changed_after_the_build_is_kept(self) -> None:
        write_tree(self.pkg, {"Makefile": self.MAKEFILE.replace(
            "-o $@ k.o\n", "-o $@ k.o\n\tln -sf libk.so libk.so.1\n")})
        subprocess.run(["make", "-s", "-C", self.pkg, "-B"], check=True)
        self.assertOk(self.add())
        link = os.path.join(self.pkg, "libk.so.1")
        os.unlink(link)
        os.symlink("elsewhere.so", link)  # the user's own link now
        rc, out, err = self.tool("revert")
        self.assertEqual(rc, 3, err)
        self.assertIn("overlay_setup: E510 kept %s: changed after" % link, err)
        self.assertEqual(os.readlink(link), "elsewhere.so")

    def test_a_build_directory_of_tracked_files_only_still_has_its_products_removed(
            self) -> None:
        bare = os.path.join(self.tmp, "bare")
        write_tree(bare, {"k.c": "int k;\n", "old.txt": "the build deletes me\n"})
        os.unlink(os.path.join(bare, "old.txt"))
        before = tree_state(bare)
        self.assertOk(self.tool("add-native", "--source", os.path.join(bare, "k.c"),
                                "--patched", os.path.join(self.tmp, "fast.c"), "--build-cmd",
                                "cc -c -o k.o k.c", "--build-cwd", bare))
        self.assertTrue(os.path.isfile(os.path.join(bare, "k.o")))
        self.assertEqual(self.tool("revert"), (0, "entry 1 restored: %s\n%sreverted %s\n"
                                               % (shown(os.path.join(bare, "k.c")), checked(bare),
                                                  self.state), ""))
        self.assertEqual(tree_state(bare), before)

    def test_revert_names_what_it_checked_and_an_install_prefix_is_watched_by_artifact(
            self) -> None:
        prefix = os.path.join(self.tmp, "prefix")
        write_tree(self.pkg, {"Makefile": self.MAKEFILE + "install: libk.so\n"
                              "\tmkdir -p $(PREFIX)/lib && cp -p libk.so $(PREFIX)/lib/\n"})
        subprocess.run(["make", "-s", "-C", self.pkg, "install", "PREFIX=" + prefix], check=True)
        before = (tree_state(self.pkg), tree_state(prefix))
        build = "make install PREFIX=%s" % prefix
        # A PREFIX=DIR word names the prefix: watched as a build directory.
        self.assertOk(self.add("--build-cmd", build))
        rc, out, err = self.tool("revert")
        self.assertEqual((rc, err), (0, ""))
        self.assertTrue(out.endswith(checked(self.pkg, prefix) + "reverted %s\n" % self.state),
                        out)
        self.assertEqual((tree_state(self.pkg), tree_state(prefix)), before)
        # A prefix the command does not name is watched by the --artifact's folder.
        write_text_file(os.path.join(self.pkg, "prefix.mk"), "PREFIX = %s\n" % prefix)
        write_tree(self.pkg, {"Makefile": "include prefix.mk\n" + read_text(
            os.path.join(self.pkg, "Makefile"))})
        build = "make install"
        before = (tree_state(self.pkg), tree_state(prefix))
        installed = os.path.join(prefix, "lib", "libk.so")
        self.assertOk(self.add("--build-cmd", build, "--artifact", installed))
        rc, out, err = self.tool("revert")
        self.assertEqual((rc, err), (0, ""))
        self.assertTrue(out.endswith(checked(self.pkg, os.path.dirname(installed))
                                     + "reverted %s\n" % self.state), out)
        self.assertEqual((tree_state(self.pkg), tree_state(prefix)), before)


class PreExistingFileTest(MadePackageTest):
    """A small pre-existing file the build rewrites or deletes (a version
    file, a stale note) comes back at revert from the copy taken before the
    build, while it is still what the build left."""

    PATCHED = ("fast.c", "faster.c")

    def setUp(self) -> None:
        super().setUp()
        self.version = os.path.join(self.pkg, "_version.py")
        write_tree(self.pkg, {"_version.py": "version = '1.0'\n",
                              "__init__.py": "from ._version import version\n"})

    def link_step_runs(self, line: str, files: dict = None) -> dict:
        """The package's link step runs `line` too, `files` lie beside it;
        returns the tree as it is before the overlay."""
        write_tree(self.pkg, dict(files or {}, Makefile=self.MAKEFILE.replace(
            "-o $@ k.o\n", "-o $@ k.o\n\t%s\n" % line)))
        return tree_state(self.pkg)

    def add(self, build: str = "make") -> tuple:
        return self.tool("add-native", "--source", os.path.join(self.pkg, "k.c"), "--patched",
                         os.path.join(self.tmp, "fast.c"), "--build-cmd", build,
                         "--build-cwd", self.pkg)

    def reverted(self) -> tuple:
        return (0, "entry 1 restored: %s\n%sreverted %s\n"
                % (shown(os.path.join(self.pkg, "k.c")), checked(self.pkg), self.state), "")

    def test_a_version_file_the_build_rewrites_comes_back_byte_exact(self) -> None:
        before = self.link_step_runs("echo \"version = '1.0+dirty'\" > _version.py")
        rc, out, err = self.add()
        self.assertEqual((rc, err), (0, ""))
        self.assertIn("the build rewrote or deleted %s; revert puts back the copies taken "
                      "before it\n" % shown(self.version), out)
        self.assertEqual(read_text(self.version), "version = '1.0+dirty'\n")
        # The copies of the files the build left alone (Makefile, __init__.py) are dropped.
        entry = read_json(os.path.join(self.state, "journal.json"))["entries"][0]
        self.assertEqual([(record["role"], record["path"]) for record in entry["protected"]],
                         [("pre-existing file", self.version),
                          ("build product", os.path.join(self.pkg, "k.o")),
                          ("build product", os.path.join(self.pkg, "libk.so"))])
        self.assertEqual([name for name in os.listdir(os.path.join(self.state, "backups", "1"))
                          if name.startswith("o")], [os.path.basename(entry["protected"][0][
                              "backup"])])
        self.assertEqual(self.tool("revert"), self.reverted())
        self.assertEqual(tree_state(self.pkg), before)

    def test_a_program_a_script_build_relinks_is_a_build_product_backed_up_and_put_back(
            self) -> None:
        # One rule for what a build makes: the ELF program `helper` has no
        # product's name, yet it is backed up like libk.so, not lost.
        write_tree(self.pkg, {"helper.c": "int main(void) { return 0; }\n", "build.sh":
                              "cc -O1 -fPIC -shared -o libk.so k.c && cc -o helper helper.c\n"})
        quiet(["sh", "build.sh"], self.pkg).check_returncode()
        age_tree(self.pkg)
        before = tree_state(self.pkg)
        rc, out, err = self.add("sh build.sh")
        self.assertEqual((rc, err), (0, ""))
        entry = read_json(os.path.join(self.state, "journal.json"))["entries"][0]
        self.assertIn(("build product", os.path.join(self.pkg, "helper")),
                      [(record["role"], record["path"]) for record in entry["protected"]])
        self.assertEqual(self.tool("revert"), self.reverted())
        self.assertEqual(tree_state(self.pkg), before)

    def test_a_pre_existing_file_the_build_deletes_comes_back(self) -> None:
        before = self.link_step_runs("rm -f stale.txt", {"stale.txt": "old\n"})
        rc, out, err = self.add()
        self.assertEqual((rc, err), (0, ""))
        self.assertFalse(os.path.lexists(os.path.join(self.pkg, "stale.txt")))
        self.assertEqual(self.tool("revert"), self.reverted())
        self.assertEqual(tree_state(self.pkg), before)

    def test_a_rewritten_file_edited_after_the_build_is_kept(self) -> None:
        before = self.link_step_runs("echo \"version = '1.0+dirty'\" > _version.py")
        self.assertOk(self.add())
        write_tree(self.pkg, {"_version.py": "version = '1.0+mine'\n"})
        rc, out, err = self.tool("revert")
        self.assertEqual((rc, out), (3, self.reverted()[1]))
        self.assertEqual(err, "overlay_setup: E510 kept %s: changed after the overlay's build "
                              "(not what the build left, nor the original), so it is not the "
                              "overlay's to restore or remove; run `overlay_setup.py --state %s "
                              "revert --force` to restore or remove it all the same\n"
                         % (self.version, self.state))
        self.assertEqual(read_text(self.version), "version = '1.0+mine'\n")
        after = tree_state(self.pkg)
        del after["_version.py"], before["_version.py"]
        self.assertEqual(after, before)

    def test_force_puts_the_original_back_over_an_edit_after_the_build(self) -> None:
        before = self.link_step_runs("echo \"version = '1.0+dirty'\" > _version.py")
        self.assertOk(self.add())
        write_tree(self.pkg, {"_version.py": "version = '1.0+mine'\n"})
        self.assertEqual(self.tool("revert", "--force"), self.reverted())
        self.assertEqual(tree_state(self.pkg), before)

    def test_a_run_killed_while_its_build_rewrote_a_version_file_gets_it_back(self) -> None:
        # One state directory: the second run's files go beside the first's.
        for signal_name, status, folder in (("KILL", -9, "1"), ("TERM", 143, "1-2")):
            with self.subTest(signal_name):
                self.killed_while_its_build_rewrote_a_version_file(signal_name, status, folder)

    def killed_while_its_build_rewrote_a_version_file(self, signal_name: str, status: int,
                                                       folder: str) -> None:
        before = self.link_step_runs("printf 'version = ' > _version.py")  # half written
        killed = forked_tool(["--state", self.state, "add-native", "--source",
                              os.path.join(self.pkg, "k.c"), "--patched",
                              os.path.join(self.tmp, "fast.c"), "--build-cmd",
                              "make && kill -%s $PPID" % signal_name, "--build-cwd", self.pkg],
                             own=True)
        self.assertEqual(killed.returncode, status, killed.stderr)
        self.assertEqual(read_text(self.version), "version = ")
        aside = os.path.join(self.state, "leftovers", folder)
        rc, out, err = call("gc-stale", "--root", self.tmp)
        self.assertEqual((rc, err), (
            0, "entry 1: the run stopped before it recorded what its build made; 1 file(s) that "
            "appeared or changed in %s since the build began (its products, or your own edits) "
            "are moved to %s: _version.py; the copies of _version.py taken before the build are "
            "put back\n" % (self.pkg, aside)))
        self.assertEqual(tree_state(self.pkg), before)
        self.assertEqual(read_text(os.path.join(aside, "_version.py")), "version = ")
        self.assertEqual(quiet([sys.executable, "-c", "import pkg; print(pkg.version)"],
                               self.tmp).stdout, "1.0\n")

    def test_a_file_over_the_budget_is_named_and_left_as_the_build_wrote_it(self) -> None:
        big = os.path.join(self.pkg, "table.txt")
        limit = overlay_setup.ORIGINAL_FILE_LIMIT
        before = self.link_step_runs("echo rewritten > table.txt; echo rewritten > fits.txt", {
            "table.txt": "x" * limit + "\n", "fits.txt": "x" * (limit - 1) + "\n"})
        rc, out, err = self.add()
        self.assertEqual(rc, 0, err)
        self.assertEqual(err, "warning: the build rewrote files that nothing backed up, so revert "
                              "cannot give them back byte-exact (it leaves them as the build "
                              "wrote them): {0}; next time pass --protect {0}\n".format(big))
        rc, out, err = self.tool("revert")
        self.assertEqual((rc, out), (3, self.reverted()[1]))
        self.assertEqual(err, "overlay_setup: E506 not byte-exact: the build rewrote {0} with no "
                              "backup; the next build makes it again (to keep it next time, pass "
                              "--protect {0})\n".format(big))
        self.assertEqual(read_text(big), "rewritten\n")
        after = tree_state(self.pkg)
        del after["table.txt"], before["table.txt"]
        self.assertEqual(after, before)  # fits.txt, of the limit's size, is back

    def test_a_deleted_file_made_again_after_the_build_is_kept(self) -> None:
        stale = os.path.join(self.pkg, "stale.txt")
        self.link_step_runs("rm -f stale.txt", {"stale.txt": "old\n"})
        self.assertOk(self.add())
        write_text_file(stale, "mine\n")
        rc, out, err = self.tool("revert")
        self.assertEqual((rc, out), (3, self.reverted()[1]))
        self.assertTrue(err.startswith("overlay_setup: E510 kept %s: changed after the "
                                       "overlay's build" % stale), err)
        self.assertEqual(read_text(stale), "mine\n")

    def test_the_files_nearest_the_build_directory_are_copied_first(self) -> None:
        self.addCleanup(setattr, overlay_setup, "ORIGINAL_COUNT", overlay_setup.ORIGINAL_COUNT)
        overlay_setup.ORIGINAL_COUNT = 3  # Makefile, __init__.py, _version.py
        deep = os.path.join(self.pkg, "gen", "config.h")
        before = self.link_step_runs("echo 2 > gen/config.h; echo \"version = '2'\" > _version.py",
                                     {"gen/config.h": "1\n"})
        rc, out, err = self.add()
        self.assertEqual(rc, 0, err)
        self.assertIn("the build rewrote or deleted %s; revert puts back" % shown(self.version),
                      out)
        rc, out, err = self.tool("revert")
        self.assertEqual((rc, err), (3, "overlay_setup: E506 not byte-exact: the build rewrote "
                                        "{0} with no backup; the next build makes it again (to "
                                        "keep it next time, pass --protect {0})\n".format(deep)))
        after = tree_state(self.pkg)
        del after["gen/config.h"], before["gen/config.h"]
        self.assertEqual(after, before)

    def test_an_update_keeps_the_copy_of_the_original_not_the_first_builds_rewrite(
            self) -> None:
        before = self.link_step_runs("echo '# built' >> _version.py")
        self.assertOk(self.add())
        rc, out, err = self.tool("update", "--patched", os.path.join(self.tmp, "faster.c"))
        self.assertEqual((rc, err), (0, ""))
        self.assertEqual(read_text(self.version), "version = '1.0'\n# built\n# built\n")
        self.assertEqual(self.tool("revert"), self.reverted())
        self.assertEqual(tree_state(self.pkg), before)

class RevertExactnessTest(MadePackageTest):
    """What revert puts back, and what it leaves alone, each pinned on its own:
    the times of every file and directory it restores, a pre-existing file a
    killed build rewrote without a copy, a directory it did not create."""

    link_step_runs = PreExistingFileTest.link_step_runs

    def add(self, *more: str) -> tuple:
        return self.tool("add-native", "--source", os.path.join(self.pkg, "k.c"), "--patched",
                         os.path.join(self.tmp, "k_new.c"), "--build-cmd", "make",
                         "--build-cwd", self.pkg, *more)

    def times(self) -> dict:
        return dict({path: info[3] for path, info in tree_state(self.pkg).items()},
                    **{".": os.lstat(self.pkg).st_mtime_ns})

    def test_revert_puts_back_the_mtime_of_every_file_and_directory_it_restores(self) -> None:
        states = [("same filesystem", self.state)]
        if shm_available():
            other = tempfile.mkdtemp(prefix="overlay-test-", dir="/dev/shm")
            self.addCleanup(shutil.rmtree, other, True)
            states.append(("backups on another filesystem", os.path.join(other, "state")))
        before = self.times()
        self.assertEqual(sorted(before), [".", "Makefile", "k.c", "k.o", "libk.so"])
        for where, state in states:
            with self.subTest(where):
                self.state = state
                self.assertOk(self.add())
                self.assertNotEqual(self.times(), before)
                self.assertOk(self.tool("revert"))
                self.assertEqual(self.times(), before)
                self.assertEqual(tree_state(self.pkg), self.before)

    def test_a_cache_set_aside_comes_back_with_its_mtime(self) -> None:
        cache = os.path.join(self.pkg, "cache")
        write_tree(cache, {"entry": "cached\n"})
        os.utime(cache, ns=(1_000_000_000, 1_000_000_000))
        before = self.times()
        self.assertOk(self.tool("add-native", "--source", os.path.join(self.pkg, "k.c"),
                                "--patched", os.path.join(self.tmp, "k_new.c"), "--build-cmd",
                                "make && mkdir -p cache && echo new > cache/entry",
                                "--build-cwd", self.pkg, "--invalidate-cache", cache))
        self.assertOk(self.tool("revert"))
        self.assertEqual(self.times(), before)
        self.assertEqual(read_text(os.path.join(cache, "entry")), "cached\n")

    def test_a_pre_existing_file_a_killed_build_rewrote_without_a_copy_stays_named(
            self) -> None:
        big = os.path.join(self.pkg, "table.txt")
        before = self.link_step_runs("echo rewritten > table.txt; echo made > new.txt", {
            "table.txt": "x" * overlay_setup.ORIGINAL_FILE_LIMIT + "\n"})
        killed = forked_tool(["--state", self.state, "add-native", "--source",
                              os.path.join(self.pkg, "k.c"), "--patched",
                              os.path.join(self.tmp, "k_new.c"), "--build-cmd",
                              "make && kill -KILL $PPID", "--build-cwd", self.pkg], own=True)
        self.assertEqual(killed.returncode, -9, killed.stderr)
        rc, out, err = call("gc-stale", "--root", self.tmp)
        aside = os.path.join(self.state, "leftovers", "1")
        self.assertEqual(rc, 3, err)
        self.assertRegex(out, r"^stale: %s \(owner pid \d+ on \S+ \(gone\)\): reverted\n\Z"
                         % re.escape(self.state))
        self.assertEqual(err, "entry 1: the run stopped before it recorded what its build made; 1 "
                              "file(s) that appeared or changed in %s since the build began (its "
                              "products, or your own edits) are moved to %s: new.txt\n"
                              "overlay_setup: E506 not byte-exact: the build rewrote {0} with no "
                              "backup; the next build makes it again (to keep it next time, pass "
                              "--protect {0})\n".format(big) % (self.pkg, aside))
        self.assertEqual(read_text(big), "rewritten\n")  # in place, as the build left it
        self.assertEqual(sorted(os.listdir(aside)), ["new.txt"])
        after = tree_state(self.pkg)
        del after["table.txt"], before["table.txt"]
        self.assertEqual(after, before)

    def test_a_directory_the_record_says_was_there_before_the_build_stays(self) -> None:
        # A product record of a directory with "created": false comes from
        # two builds of one entry (a file the first rewrote, the second made
        # a directory); whatever it came from, what the build did not create
        # revert does not remove.
        notes = os.path.join(self.pkg, "notes")
        os.mkdir(notes)
        self.before = tree_state(self.pkg)
        self.assertOk(self.add())
        path = os.path.join(self.state, "journal.json")
        journal = read_json(path)
        journal["entries"][0]["untracked"].append({"path": notes, "kind": "d", "created": False})
        write_json(path, journal)
        self.assertOk(self.tool("revert"))
        self.assertTrue(os.path.isdir(notes))
        self.assertEqual(tree_state(self.pkg), self.before)

    def test_a_folder_an_update_built_where_the_first_build_deleted_a_file(self) -> None:
        # The first build deleted a file nothing backed up; the update's build
        # made a folder there.  Revert removes the folder and names the lost
        # file (E506), rather than keeping the folder as if it were the install's.
        path = os.path.join(self.pkg, "notes")
        merged = overlay_setup.merge_products(
            [{"path": path, "kind": "f", "created": False, "deleted": True}],
            [{"path": path, "kind": "d", "created": True}])
        self.assertEqual(overlay_setup.inexact_products(merged), [(path, "deleted")])
        os.mkdir(path)
        overlay_setup.remove_products(merged)
        self.assertFalse(os.path.lexists(path))
        # A file the first build created and the update rebuilt stays created.
        merged = overlay_setup.merge_products(
            [{"path": path, "kind": "f", "created": True}],
            [{"path": path, "kind": "f", "created": False}])
        self.assertEqual(merged, [{"path": path, "kind": "f", "created": True}])


class PlanRunsNothingTest(OverlayTestCase):
    """Nothing of the install's build description runs before the entry is
    journaled, and --dry-run changes no byte, mode or mtime of the tree."""

    SOURCE = "double k(void) { return 1.0; }\n"
    MAKEFILE = ("RAN := $(shell echo evaluated >> shell-ran)\n"
                "libk.so: k.o\n\t$(CC) -shared -o $@ k.o\n"
                "k.o: k.c\n\t$(CC) -O1 -fPIC -c -o $@ k.c\n")
    NINJA = ("rule cc\n  command = cc -O1 -fPIC -c $in -o $out\n"
             "rule link\n  command = cc -shared -o $out $in\n"
             "build k.o: cc k.c\nbuild libk.so: link k.o\n")
    OLD_LOG = "# ninja log v4\n0\t5\t0\tk.o\t1\n5\t9\t0\tlibk.so\t2\n"
    CMAKE = ("cmake_minimum_required(VERSION 3.10)\nproject(k C)\n"
             "add_library(k SHARED k.c)\n")

    def setUp(self) -> None:
        super().setUp()
        write_text_file(os.path.join(self.tmp, "fast.c"), "double k(void) { return 2.0; }\n")

    def project(self, name: str, files: dict) -> str:
        root = os.path.join(self.tmp, name)
        write_tree(root, dict(files, **{"k.c": self.SOURCE}))
        return root

    def make_project(self) -> str:
        root = self.project("make", {"Makefile": self.MAKEFILE})
        quiet(["make"], root).check_returncode()
        os.unlink(os.path.join(root, "shell-ran"))
        return root

    def ninja_project(self) -> str:
        root = self.project("ninja", {"build.ninja": self.NINJA})
        quiet(["ninja"], root).check_returncode()
        write_text_file(os.path.join(root, ".ninja_log"), self.OLD_LOG)  # an older ninja's
        return root

    def dry_run(self, root: str, command: str, build_cwd: str) -> tuple:
        return self.tool("add-native", "--source", os.path.join(root, "k.c"), "--patched",
                         os.path.join(self.tmp, "fast.c"), "--build-cmd", command,
                         "--build-cwd", build_cwd, "--dry-run")

    def test_dry_run_on_each_build_system_changes_nothing_and_runs_nothing(self) -> None:
        builds = [(self.make_project(), "make", None), (self.ninja_project(), "ninja", None)]
        setuptools = self.project("setuptools", {"setup.py": (
            "open('setup-ran', 'w').close()\n"
            "from setuptools import setup, Extension\n"
            "setup(name='k', ext_modules=[Extension('k', ['k.c'])])\n")})
        builds.append((setuptools, "%s setup.py build_ext --inplace" % sys.executable, None))
        if shutil.which("cmake"):
            for generator in ("Unix Makefiles", "Ninja"):
                root = self.project("cmake-" + generator.split()[0].lower(),
                                    {"CMakeLists.txt": self.CMAKE})
                build = os.path.join(root, "build")
                quiet(["cmake", "-S", root, "-B", build, "-G", generator],
                      root).check_returncode()
                quiet(["cmake", "--build", build], root).check_returncode()
                builds.append((root, "cmake --build build", build))
        for root, command, build in builds:
            with self.subTest(command=command, directory=os.path.basename(root)):
                before = tree_state(root)
                rc, out, err = self.dry_run(root, command, root)
                self.assertEqual((rc, err), (0, ""), out)
                self.assertTrue(out.startswith("plan (--dry-run: nothing was changed):\n"), out)
                self.assertEqual(tree_state(root), before)
                self.assertFalse(os.path.exists(os.path.join(root, "shell-ran")))
                self.assertFalse(os.path.exists(os.path.join(root, "setup-ran")))
        self.assertFalse(os.path.exists(self.state))

    def test_make_evaluates_the_makefile_only_once_the_entry_is_journaled(self) -> None:
        root = self.make_project()
        write_tree(root, {"Makefile": self.MAKEFILE.replace(
            "echo evaluated", "grep -c applying %s/journal.json" % self.state)})
        before = tree_state(root)
        rc, out, err = self.tool("add-native", "--source", os.path.join(root, "k.c"), "--patched",
                                 os.path.join(self.tmp, "fast.c"), "--build-cmd", "make",
                                 "--build-cwd", root)
        self.assertEqual((rc, err.count("E")), (0, 0), err)
        # one line for make's plan, one for the build: both saw the journaled entry
        self.assertEqual(read_text(os.path.join(root, "shell-ran")), "1\n1\n")
        self.assertIn("(predicted by make -n -W)", out)
        rc, out, err = self.tool("revert")
        self.assertEqual((rc, err), (0, ""), out)
        self.assertEqual(tree_state(root), before)

    def test_asking_ninja_for_its_plan_leaves_an_older_ninjas_log_as_it_was(self) -> None:
        root = self.ninja_project()
        before = tree_state(root)
        rc, out, err = self.tool("add-native", "--source", os.path.join(root, "k.c"), "--patched",
                                 os.path.join(self.tmp, "fast.c"), "--build-cmd", "ninja",
                                 "--build-cwd", root)
        self.assertEqual(rc, 0, err)
        self.assertIn("%s (predicted from ninja's graph)" % os.path.relpath(os.path.join(root, ".ninja_log")),
                      out)
        self.assertOk(self.tool("revert"))
        self.assertEqual(tree_state(root), before)
        self.assertEqual(read_text(os.path.join(root, ".ninja_log")), self.OLD_LOG)


class RefusalTest(OverlayTestCase):
    """Each remaining refusal, with its exact message; nothing changes."""

    def setUp(self) -> None:
        super().setUp()
        self.proj = os.path.join(self.tmp, "proj")
        write_tree(self.proj, {"k.c": "int k;\n", "fast.c": "int k = 7;\n", "cache/x": "x\n"})
        self.source = os.path.join(self.proj, "k.c")
        self.fast = os.path.join(self.proj, "fast.c")

    def add(self, *extra: str) -> tuple:
        return self.tool("add-native", "--source", self.source, "--patched", self.fast, *extra)

    def test_symlinked_source_is_refused(self) -> None:
        link = os.path.join(self.proj, "link.c")
        os.symlink(self.source, link)
        self.assertEqual(self.tool("add-native", "--source", link, "--patched", self.fast,
                                   "--no-build"), (
            1, "", "overlay_setup: E104 source %s is a symlink; pass the file it points to (%s)\n"
            % (link, self.source)))

    def test_a_directory_as_source_is_named_as_one_not_as_missing(self) -> None:
        self.assertEqual(self.tool("add-native", "--source", self.proj, "--patched", self.fast,
                                   "--no-build"), (
            2, "", "overlay_setup: E102 --source %s is a directory, not a file; pass the "
            "installed file to patch\n" % self.proj))

    def test_a_fifo_as_source_is_named_as_one_not_as_missing(self) -> None:
        fifo = os.path.join(self.proj, "pipe.c")
        os.mkfifo(fifo)
        self.assertEqual(self.tool("add-native", "--source", fifo, "--patched", self.fast,
                                   "--no-build"), (
            2, "", "overlay_setup: E102 --source %s is a special file (fifo, socket or device), not "
            "a file; pass the installed file to patch\n" % fifo))

    def test_source_inside_an_invalidated_cache_is_refused(self) -> None:
        cache = os.path.dirname(self.source)
        self.assertEqual(self.add("--invalidate-cache", cache, "--no-build"), (
            1, "", "overlay_setup: E106 %s lies inside --invalidate-cache %s, which is set aside "
            "whole; drop one of them\n" % (self.source, cache)))

    def test_missing_build_directory_is_refused(self) -> None:
        self.assertEqual(self.add("--build-cmd", "make", "--build-cwd", "/nonexistent"), (
            2, "", "overlay_setup: E107 --build-cwd /nonexistent is not a directory; pass the "
            "directory the build command runs in\n"))

    def test_build_command_and_no_build_exclude_each_other(self) -> None:
        self.assertEqual(self.add("--build-cmd", "make", "--no-build"), (
            2, "", "overlay_setup: E100 argument --no-build: not allowed with argument --build-cmd; "
            "see overlay_setup.py add-native --help\n"))

    def test_module_already_overlaid_is_refused(self) -> None:
        self.assertOk(self.tool("add-python", "pkg.mod", self.fast))
        self.assertEqual(self.tool("add-python", "pkg.mod", self.fast), (
            1, "", "overlay_setup: E103 module pkg.mod is already overlaid; run "
            "`overlay_setup.py --state %s revert` first\n" % self.state))

    def test_unreadable_journal_is_refused(self) -> None:
        self.assertOk(self.tool("init"))
        write_text_file(os.path.join(self.state, "journal.json"), "{not json")
        rc, out, err = self.tool("revert")
        self.assertEqual((rc, out), (1, ""))
        self.assertRegex(err, r"^overlay_setup: E202 journal %s/journal.json is unreadable "
                              r"\(.*\); inspect it, or move the state directory away if nothing "
                              r"is applied\n$" % self.state)

    def test_state_path_that_is_a_file_is_refused(self) -> None:
        write_text_file(self.state, "")
        self.assertEqual(self.tool("init"), (
            1, "", "overlay_setup: E206 state directory %s is not a directory; pass another "
            "--state\n" % self.state))

    def test_missing_backup_is_refused_before_anything_changes(self) -> None:
        self.assertOk(self.add("--no-build"))
        journal = read_json(os.path.join(self.state, "journal.json"))
        os.unlink(os.path.join(self.state, journal["entries"][0]["sources"][0]["backup"]))
        self.assertEqual(self.tool("revert"), (
            1, "", "overlay_setup: E503 the backup of %s is missing from %s; nothing was changed: "
            "restore that file by hand, then remove entry 1 from the journal\n"
            % (self.source, self.state)))
        self.assertEqual(read_text(self.source), "int k = 7;\n")

    def test_new_file_in_a_missing_directory_is_refused(self) -> None:
        write_tree(self.tmp, {"new.diff": "--- /dev/null\n+++ b/sub/new.c\n@@ -0,0 +1 @@\n+int n;\n"})
        self.assertEqual(self.tool("apply", os.path.join(self.tmp, "new.diff"), "--root",
                                   self.proj, "--no-build"), (
            2, "", "overlay_setup: E102 new.diff: the directory of sub/new.c does not exist under "
            "%s; create it first (the overlay does not create directories)\n" % self.proj))

    def test_renaming_patch_is_refused(self) -> None:
        write_tree(self.tmp, {"mv.diff": "diff --git a/k.c b/k2.c\nsimilarity index 100%\n"
                                         "rename from k.c\nrename to k2.c\n"})
        self.assertEqual(self.tool("apply", os.path.join(self.tmp, "mv.diff"), "--root",
                                   self.proj, "--no-build"), (
            1, "", "overlay_setup: E305 mv.diff: renames and copies are not supported; regenerate "
            "the patch with `git diff --no-renames`\n"))

    def test_file_created_where_a_directory_now_stands_is_refused_on_revert(self) -> None:
        new = os.path.join(self.proj, "new.c")
        before = tree_state(self.proj)
        write_tree(self.tmp, {"new.diff": "--- /dev/null\n+++ b/new.c\n@@ -0,0 +1 @@\n+int n;\n"})
        self.assertOk(self.tool("apply", os.path.join(self.tmp, "new.diff"), "--root", self.proj,
                                "--no-build"))
        os.unlink(new)
        os.mkdir(new)
        self.assertEqual(self.tool("revert", "--force"), (
            1, "", "overlay_setup: E504 %s is now a directory where the overlay removes a file; "
            "nothing was reverted: move it away by hand, then run revert again\n" % new))
        os.rmdir(new)
        self.assertOk(self.tool("revert"))
        self.assertEqual(tree_state(self.proj), before)


class PatchTest(OverlayTestCase):
    """`apply` with real git diffs: natives in place, .py to the overlay."""

    def setUp(self) -> None:
        super().setUp()
        self.proj = self.built_copy(os.path.join(self.tmp, "proj"), KERNELS,
                                    ["make", "-j2", "-s"])
        self.work = os.path.join(self.tmp, "work")
        shutil.copytree(self.proj, self.work, symlinks=True)
        git = ["git", "-c", "user.name=t", "-c", "user.email=t@t", "-C", self.work]
        subprocess.run(git + ["init", "-q"], check=True)
        subprocess.run(git + ["add", "-A"], check=True)
        subprocess.run(git + ["commit", "-qm", "base"], check=True)
        self.git = git
        on_python_path(self, self.proj)

    def test_update_replaces_the_whole_change_a_source_left_out_goes_back(self) -> None:
        before = tree_state(self.proj)
        p = functools.partial(os.path.join, self.proj)
        both = self.make_patch({"kernel_a.c": KERNELS["kernel_a.c"].replace("1.0", "2.0"),
                                "kernel_c.c": KERNELS["kernel_c.c"].replace("9.0", "3.0"),
                                "new.c": "int n;\n"}, name="both.diff")
        one = self.make_patch({"kernel_a.c": KERNELS["kernel_a.c"].replace("1.0", "5.0")},
                              name="one.diff")
        self.assertOk(self.tool("apply", both, "--root", self.proj, "--no-build"))
        rc, out, err = self.tool("update", one, "--root", self.proj)
        self.assertEqual((rc, err), (0, ""))
        self.assertIn("entry 1 updated: %s; back to the original, as the patch no longer "
                      "changes them: %s, %s;" % (shown(p("kernel_a.c")), shown(p("kernel_c.c")),
                                                 shown(p("new.c"))), out)
        self.assertEqual(read_text(p("kernel_c.c")), KERNELS["kernel_c.c"])
        self.assertFalse(os.path.exists(p("new.c")))
        self.assertIn("5.0", read_text(p("kernel_a.c")))
        self.assertOk(self.tool("revert"))
        self.assertEqual(tree_state(self.proj), before)

    def make_patch(self, edits: dict, deletes: tuple = (), name: str = "change.diff") -> str:
        """A real `git diff` of edits made in the work copy."""
        for relative, content in edits.items():
            write_tree(self.work, {relative: content})
        for relative in deletes:
            os.unlink(os.path.join(self.work, relative))
        subprocess.run(self.git + ["add", "-A"], check=True)
        diff = subprocess.run(self.git + ["diff", "--cached"], check=True,
                              stdout=subprocess.PIPE).stdout
        subprocess.run(self.git + ["reset", "-q", "--hard"], check=True)
        path = os.path.join(self.tmp, name)
        with open(path, "wb") as handle:
            handle.write(diff)
        return path

    def test_mixed_python_and_c_patch_round_trips(self) -> None:
        before = tree_state(self.proj)
        patch = self.make_patch({
            "kernel_b.c": KERNELS["kernel_b.c"].replace("4.0", "7.0"),
            "pkg/mathops.py": "def scale():\n    return 3\n"})
        rc, out, err = self.tool("apply", patch, "--root", self.proj,
                                 "--artifact", os.path.join(self.proj, "kernel_b.o"),
                                 "--artifact", os.path.join(self.proj, "libkernels.so"),
                                 "--invalidate-cache", os.path.join(self.proj, "cache"),
                                 "--build-cmd", "make -j2", "--build-cwd", self.proj)
        self.assertEqual((rc, err), (0, ""))
        self.assertIn("applied change.diff: entry 1: 1 native file(s); 1 Python module(s) "
                      "overlaid (pkg.mathops), seen by processes started after `eval "
                      "\"$(overlay_setup.py --state %s env)\"`; run `overlay_setup.py --state %s "
                      "revert` to take it back" % (self.state, self.state), out)
        self.assertEqual(self.tool("verify-native")[0], 0)

        env_line = self.tool("env")[1].splitlines()[0]
        probe = ("import ctypes, pkg.mathops; lib = ctypes.CDLL(%r); "
                 "lib.run_b.restype = ctypes.c_double; print(pkg.mathops.scale(), lib.run_b())"
                 % os.path.join(self.proj, "libkernels.so"))
        script = '%s; cd %s && "%s" -c "$1"' % (env_line, self.proj, sys.executable)
        seen = subprocess.run(["sh", "-c", script, "sh", probe], stdout=subprocess.PIPE,
                              env=NO_BYTECODE, universal_newlines=True, check=True).stdout
        self.assertEqual(seen, "3 7.0\n")
        with open(os.path.join(self.proj, "pkg/mathops.py")) as handle:
            self.assertEqual(handle.read(), KERNELS["pkg/mathops.py"])

        self.assertOk(self.tool("revert"))
        self.assertEqual(tree_state(self.proj), before)
        seen = subprocess.run(["sh", "-c", script, "sh", probe], stdout=subprocess.PIPE,
                              env=NO_BYTECODE, universal_newlines=True, check=True).stdout
        self.assertEqual(seen, "2 4.0\n")

    def test_new_and_deleted_files_with_plain_diff_and_p0(self) -> None:
        before = tree_state(self.proj)
        stamp = "\t2026-01-01 00:00:00.000000000 +0000\n"
        diff = ("--- kernel_c.c" + stamp + "+++ /dev/null" + stamp + "@@ -1,2 +0,0 @@\n"
                + "".join("-" + line for line in KERNELS["kernel_c.c"].splitlines(True))
                + "--- /dev/null" + stamp + "+++ kernel_d.c" + stamp + "@@ -0,0 +1 @@\n"
                "+double kernel_d(void) { return 2.0; }\n"
                "--- /dev/null" + stamp + "+++ pkg/fresh.py" + stamp + "@@ -0,0 +1 @@\n"
                "+VALUE = 11\n")
        patch = os.path.join(self.tmp, "plain.diff")
        write_tree(self.tmp, {"plain.diff": diff})
        self.assertOk(self.tool("apply", patch, "--root", self.proj, "-p", "0", "--no-build"))
        self.assertFalse(os.path.exists(os.path.join(self.proj, "kernel_c.c")))
        self.assertTrue(os.path.isfile(os.path.join(self.proj, "kernel_d.c")))
        env = json.loads(self.tool("env", "--json")[1])
        seen = subprocess.run([sys.executable, "-c", "import pkg.fresh; print(pkg.fresh.VALUE)"],
                              env=dict(NO_BYTECODE, PYTHONPATH=env["PYTHONPATH"]), cwd=self.proj,
                              stdout=subprocess.PIPE, universal_newlines=True, check=True).stdout
        self.assertEqual(seen, "11\n")
        self.assertOk(self.tool("revert"))
        self.assertEqual(tree_state(self.proj), before)

    def test_deleted_python_module_is_hidden_by_the_overlay(self) -> None:
        patch = self.make_patch({}, deletes=("pkg/other.py",))
        self.assertOk(self.tool("apply", patch, "--root", self.proj, "--no-build"))
        env = json.loads(self.tool("env", "--json")[1])
        probe = subprocess.run([sys.executable, "-c", "import pkg.other"], cwd=self.proj,
                               env=dict(os.environ, PYTHONPATH=env["PYTHONPATH"]),
                               stderr=subprocess.PIPE, universal_newlines=True)
        self.assertEqual(probe.returncode, 1)
        self.assertIn("ModuleNotFoundError: module 'pkg.other' is deleted by the overlay",
                      probe.stderr)
        self.assertTrue(os.path.isfile(os.path.join(self.proj, "pkg/other.py")))
        self.assertOk(self.tool("revert"))

    def test_a_wrong_hunk_changes_nothing_and_names_file_and_hunk(self) -> None:
        source = "".join("int line%d;\n" % number for number in range(1, 30))
        write_tree(self.proj, {"big.c": source})
        write_tree(self.work, {"big.c": source})
        subprocess.run(self.git + ["add", "-A"], check=True)
        subprocess.run(self.git + ["commit", "-qm", "big"], check=True)
        edited = source.replace("int line3;", "int line3x;").replace("int line25;", "int l25;")
        patch = self.make_patch({"big.c": edited,
                                 "kernel_a.c": KERNELS["kernel_a.c"].replace("1.0", "1.5")})
        write_tree(self.proj, {"big.c": source.replace("int line24;", "int changed24;")})
        before = tree_state(self.proj)
        rc, out, err = self.tool("apply", patch, "--root", self.proj, "--no-build")
        self.assertEqual((rc, out), (1, ""))
        self.assertEqual(err, "overlay_setup: E302 change.diff: hunk 2 of big.c (@@ -22,7 @@) does "
                              "not match the file at line 22; nothing was written: regenerate the "
                              "patch against the current tree\n")
        self.assertEqual(tree_state(self.proj), before)
        self.assertFalse(os.path.exists(self.state))

    def test_missing_final_newline_is_kept_on_both_sides(self) -> None:
        write_tree(self.proj, {"tail.c": "int a;\nint b;"})
        write_tree(self.work, {"tail.c": "int a;\nint b;"})
        subprocess.run(self.git + ["add", "-A"], check=True)
        subprocess.run(self.git + ["commit", "-qm", "tail"], check=True)
        patch = self.make_patch({"tail.c": "int a;\nint c;"})
        self.assertEqual(read_text(patch).count("\\ No newline at end of file"), 2)
        self.assertOk(self.tool("apply", patch, "--root", self.proj, "--no-build"))
        self.assertEqual(read_text(os.path.join(self.proj, "tail.c")), "int a;\nint c;")
        self.assertOk(self.tool("revert"))
        self.assertEqual(read_text(os.path.join(self.proj, "tail.c")), "int a;\nint b;")

    def test_unsupported_file_kind_is_refused(self) -> None:
        patch = self.make_patch({"notes.txt": "more\n"})
        self.assertEqual(self.tool("apply", patch, "--root", self.proj, "--no-build"), (
            1, "", "overlay_setup: E303 change.diff: notes.txt is neither a compiled source "
            "(.cu .cuh .hip .cpp .cc .cxx .c .h .hpp), a build file (Makefile makefile "
            "GNUmakefile CMakeLists.txt setup.py pyproject.toml *.mk *.cmake) nor a .py file; "
            "nothing was written: leave it out of the patch\n"))

    def test_a_git_diff_applied_from_a_subdirectory_names_the_root_or_p_to_pass(self) -> None:
        # git diff names paths from the repository's top, wherever it runs;
        # applied from the package's folder, or with -p 0, nothing is there.
        patch = self.make_patch({"pkg/mathops.py": "def scale():\n    return 3\n",
                                 "kernel_b.c": KERNELS["kernel_b.c"].replace("4.0", "7.0")})
        os.chdir(os.path.join(self.proj, "pkg"))
        self.assertEqual(self.tool("apply", patch, "--no-build"), (
            1, "", "overlay_setup: E302 change.diff: kernel_b.c is not under %s/pkg, where the "
            "diff's paths are read from (--root, default the current directory, after -p 1); "
            "nothing was written: pass --root %s\n" % (self.proj, self.proj)))
        os.chdir(self.proj)
        self.assertEqual(self.tool("apply", patch, "-p", "0", "--no-build"), (
            1, "", "overlay_setup: E302 change.diff: b/kernel_b.c is not under %s, where the "
            "diff's paths are read from (--root, default the current directory, after -p 0); "
            "nothing was written: pass -p 1\n" % self.proj))
        self.assertFalse(os.path.exists(self.state))

    def test_patch_paths_leaving_the_root_are_refused(self) -> None:
        write_tree(self.tmp, {"evil.diff": "--- a/../x.c\n+++ b/../x.c\n@@ -0,0 +1 @@\n+int x;\n"})
        self.assertEqual(self.tool("apply", os.path.join(self.tmp, "evil.diff"), "--root",
                                   self.proj, "--no-build"), (
            1, "", "overlay_setup: E304 evil.diff: path '../x.c' leaves the --root directory; "
            "nothing was written\n"))

    def test_patch_paths_through_a_symlink_out_of_the_root_are_refused(self) -> None:
        outside = os.path.join(self.tmp, "outside")
        write_tree(outside, {"victim.c": "int v;\n"})
        os.symlink(outside, os.path.join(self.proj, "ext"))
        write_tree(self.tmp, {"evil.diff": "--- a/ext/victim.c\n+++ b/ext/victim.c\n"
                                           "@@ -1 +1 @@\n-int v;\n+int w;\n"})
        self.assertEqual(self.tool("apply", os.path.join(self.tmp, "evil.diff"), "--root",
                                   self.proj, "--no-build"), (
            1, "", "overlay_setup: E304 evil.diff: the directory of ext/victim.c is a symlink that "
            "leads out of the --root directory %s; nothing was written\n" % self.proj))
        self.assertEqual(read_text(os.path.join(outside, "victim.c")), "int v;\n")

    def test_text_without_a_diff_is_refused(self) -> None:
        write_tree(self.tmp, {"notes.txt": "hello\n"})
        self.assertEqual(self.tool("apply", os.path.join(self.tmp, "notes.txt"), "--root",
                                   self.proj, "--no-build"), (
            1, "", "overlay_setup: E301 notes.txt holds no unified diff (no ---/+++ file headers); "
            "pass a patch made by `git diff` or `diff -u`\n"))


    def git_diff(self, change, name: str = "parts.diff") -> str:
        """A real `git diff --no-renames` of what `change(work)` does to the work copy."""
        change(self.work)
        subprocess.run(self.git + ["add", "-A"], check=True)
        diff = subprocess.run(self.git + ["diff", "--cached", "--no-renames"], check=True,
                              stdout=subprocess.PIPE).stdout
        subprocess.run(self.git + ["reset", "-q", "--hard"], check=True)
        subprocess.run(self.git + ["clean", "-qfd"], check=True)
        path = os.path.join(self.tmp, name)
        with open(path, "wb") as handle:
            handle.write(diff)
        return path

    def test_empty_files_and_mode_changes_of_a_git_diff_are_applied_and_reverted(self) -> None:
        write_tree(self.proj, {"empty_old.c": ""})
        write_tree(self.work, {"empty_old.c": ""})
        subprocess.run(self.git + ["add", "-A"], check=True)
        subprocess.run(self.git + ["commit", "-qm", "empty"], check=True)

        def change(work: str) -> None:
            write_tree(work, {"empty_new.c": "", "tool.c": "int tool;\n"})
            os.unlink(os.path.join(work, "empty_old.c"))
            os.chmod(os.path.join(work, "kernel_a.c"), 0o755)  # mode only
            os.chmod(os.path.join(work, "tool.c"), 0o755)  # a new executable file
            with open(os.path.join(work, "kernel_c.c"), "a") as handle:  # content and mode
                handle.write("/* c */\n")
            os.chmod(os.path.join(work, "kernel_c.c"), 0o755)
            os.chmod(os.path.join(work, "api.c"), 0o600)  # git sees no change: none made
        patch = self.git_diff(change)
        text = read_text(patch)
        for part in ("new file mode 100644", "deleted file mode 100644", "old mode 100644\n"
                     "new mode 100755", "new file mode 100755"):
            self.assertIn(part, text)
        before = tree_state(self.proj)
        rc, out, err = self.tool("apply", patch, "--root", self.proj, "--no-build")
        self.assertEqual((rc, err), (0, ""))
        self.assertEqual(out.splitlines()[-1], "applied parts.diff: entry 1: 5 native file(s); "
                                               "run `overlay_setup.py --state %s revert` to take "
                                               "it back" % self.state)
        p = lambda relative: os.path.join(self.proj, relative)  # noqa: E731
        mode = lambda relative: stat.S_IMODE(os.stat(p(relative)).st_mode)  # noqa: E731
        self.assertEqual(read_text(p("empty_new.c")), "")
        self.assertEqual(mode("empty_new.c"), 0o644)
        self.assertFalse(os.path.exists(p("empty_old.c")))
        self.assertEqual((mode("kernel_a.c"), read_text(p("kernel_a.c"))),
                         (0o755, KERNELS["kernel_a.c"]))
        self.assertEqual((mode("tool.c"), read_text(p("tool.c"))), (0o755, "int tool;\n"))
        self.assertEqual((mode("kernel_c.c"), read_text(p("kernel_c.c"))),
                         (0o755, KERNELS["kernel_c.c"] + "/* c */\n"))
        self.assertOk(self.tool("revert"))
        self.assertEqual(tree_state(self.proj), before)

    def test_file_headers_without_hunks_are_refused(self) -> None:
        patch = os.path.join(self.tmp, "headers.diff")
        write_text_file(patch, "diff --git a/kernel_a.c b/kernel_a.c\nindex 1111111..2222222 "
                               "100644\n--- a/kernel_a.c\n+++ b/kernel_a.c\n")
        before = tree_state(self.proj)
        self.assertEqual(self.tool("apply", patch, "--root", self.proj, "--no-build"), (
            1, "", "overlay_setup: E301 headers.diff: kernel_a.c has file headers but no hunk; "
            "nothing was written: regenerate the patch\n"))
        self.assertEqual(tree_state(self.proj), before)
        self.assertFalse(os.path.exists(self.state))

    def test_symlinks_and_mode_changes_of_python_files_are_refused_by_name(self) -> None:
        def add_link(work: str) -> None:
            os.symlink("kernel_a.c", os.path.join(work, "alias.c"))

        def chmod_module(work: str) -> None:
            os.chmod(os.path.join(work, "pkg/mathops.py"), 0o755)
        before = tree_state(self.proj)
        self.assertEqual(self.tool("apply", self.git_diff(add_link), "--root", self.proj,
                                   "--no-build"), (
            1, "", "overlay_setup: E305 parts.diff: alias.c has mode 120000 (a symlink); only "
            "regular files (100644, 100755) are supported: leave it out of the patch\n"))
        self.assertEqual(self.tool("apply", self.git_diff(chmod_module), "--root", self.proj,
                                   "--no-build"), (
            1, "", "overlay_setup: E305 parts.diff: pkg/mathops.py changes mode to 100755, but "
            "a .py file is overlaid by its content alone: leave the mode change out of the "
            "patch\n"))
        self.assertEqual(tree_state(self.proj), before)
        self.assertFalse(os.path.exists(self.state))

class PythonOverlayTest(OverlayTestCase):
    def setUp(self) -> None:
        super().setUp()
        self.proj = os.path.join(self.tmp, "proj")
        write_tree(self.proj, {
            "pkg/__init__.py": "",
            "pkg/mathops.py": "def scale():\n    return 2\n",
            "pkg/fast.py": "def scale():\n    return 8\n",
            "other_site/sitecustomize.py": "import os\nos.environ['CHAINED'] = 'yes'\n",
            "shadow.py": "def scale():\n    return 6\n"})

    def python(self, code: str, extra_path: str = "") -> str:
        env = json.loads(self.tool("env", "--json")[1])
        path = env["PYTHONPATH"] + (os.pathsep + extra_path if extra_path else "")
        return subprocess.run([sys.executable, "-c", code], cwd=self.proj,
                              env=dict(os.environ, PYTHONPATH=path), stdout=subprocess.PIPE,
                              universal_newlines=True, check=True).stdout

    def test_add_python_shadows_the_module_and_chains_sitecustomize(self) -> None:
        self.assertOk(self.tool("add-python", "pkg.mathops", os.path.join(self.proj, "shadow.py")))
        code = "import os, pkg.mathops; print(pkg.mathops.scale(), os.environ.get('CHAINED'))"
        self.assertEqual(self.python(code, os.path.join(self.proj, "other_site")), "6 yes\n")
        self.assertOk(self.tool("revert"))
        self.assertEqual(self.python(code, os.path.join(self.proj, "other_site")), "2 yes\n")

    def test_rebind_replaces_the_attribute_on_import(self) -> None:
        self.assertEqual(self.tool("rebind", "pkg.mathops:scale", "pkg.fast:scale"), (
            0, "pkg.mathops:scale is replaced by pkg.fast:scale when pkg.mathops is imported "
            "in Python processes started after `eval \"$(overlay_setup.py --state %s env)\"`\n"
            "state: %s\n" % (self.state, self.state), ""))
        self.assertEqual(self.python("import pkg.mathops; print(pkg.mathops.scale())"), "8\n")
        self.assertOk(self.tool("revert"))
        self.assertEqual(self.python("import pkg.mathops; print(pkg.mathops.scale())"), "2\n")

    def test_a_module_imported_before_the_overlay_starts_is_rebound_in_place(self) -> None:
        # json: the overlay's own sitecustomize imports it before it serves anything.
        write_tree(self.proj, {"fake_json.py": "def dumps(value):\n    return 'overlaid'\n"})
        self.assertOk(self.tool("add-python", "json", os.path.join(self.proj, "fake_json.py")))
        self.assertEqual(self.python("import json; print(json.dumps(1))"), "overlaid\n")
        self.assertOk(self.tool("revert"))
        self.assertOk(self.tool("rebind", "json:dumps", "pkg.fast:scale"))
        self.assertEqual(self.python("import json; print(json.dumps())", self.proj), "8\n")
        self.assertOk(self.tool("revert"))
        self.assertEqual(self.python("import json; print(json.dumps(1))"), "1\n")

    def test_a_state_path_holding_the_path_separator_is_refused_for_python(self) -> None:
        state = os.path.join(self.tmp, "state-2026-12-05T10:00")
        for argv in (["init"], ["add-python", "pkg.mathops", os.path.join(self.proj, "shadow.py")],
                     ["rebind", "pkg.mathops:scale", "pkg.fast:scale"], ["env"]):
            self.assertEqual(call("--state", state, *argv), (
                1, "", "overlay_setup: E213 the state directory %s holds ':', which PYTHONPATH "
                "takes for a separator, so no Python process would load the overlay; nothing "
                "was changed: pass a --state without ':' (or an XDG_STATE_HOME without it)\n"
                % state))
        self.assertFalse(os.path.exists(state))

    def test_bad_module_names_are_usage_errors(self) -> None:
        self.assertEqual(self.tool("add-python", "pkg-x", "shadow.py"), (
            2, "", "overlay_setup: E105 MODULE 'pkg-x' is not a dotted module name (e.g. pkg.mod)\n"))
        self.assertEqual(self.tool("rebind", "pkg.mathops", "pkg.fast:scale"), (
            2, "", "overlay_setup: E105 TARGET 'pkg.mathops' must look like pkg.mod:attr\n"))

    def test_init_is_idempotent_and_env_prints_the_exports(self) -> None:
        first = self.tool("init")
        self.assertEqual(first, self.tool("init"))
        self.assertEqual(first, (0, "overlay state ready at %s (owner pid %d on %s (live))\n"
                                 % (self.state, overlay_setup.default_owner(),
                                    overlay_setup.host_name()), ""))
        existing = os.environ.get("PYTHONPATH")
        expected = os.path.join(self.state, "site") + (os.pathsep + existing if existing else "")
        self.assertEqual(self.tool("env"), (0, "export PYTHONPATH=%s\nexport OVERLAY_STATE=%s\n"
                                            % (expected, self.state), ""))
        self.assertEqual(json.loads(self.tool("env", "--json")[1]),
                         {"PYTHONPATH": expected, "OVERLAY_STATE": self.state})

    def test_status_json_shows_modules_rebinds_and_a_live_owner(self) -> None:
        self.assertOk(self.tool("add-python", "pkg.mathops", os.path.join(self.proj, "shadow.py")))
        self.assertOk(self.tool("rebind", "pkg.fast:scale", "pkg.mathops:scale"))
        status = json.loads(self.tool("status", "--json")[1])
        self.assertEqual(status["owner"]["liveness"], "live")
        self.assertEqual(sorted(status["journal"]["python"]["modules"]), ["pkg.mathops"])
        self.assertEqual(status["journal"]["python"]["rebinds"],
                         {"pkg.fast:scale": "pkg.mathops:scale"})
        rc, out, err = self.tool("status")
        self.assertEqual((rc, err), (0, ""))
        self.assertIn("python: pkg.mathops <- %s\nrebind: pkg.fast:scale -> pkg.mathops:scale\n"
                      % os.path.join(self.proj, "shadow.py"), out)

    def test_env_without_an_overlay_says_what_to_run(self) -> None:
        self.assertEqual(self.tool("env"), (
            1, "", "overlay_setup: E207 no overlay at %s; run `overlay_setup.py --state %s init` "
            "first\n" % (self.state, self.state)))


def crash_fixture(root: str, other: str) -> None:
    """Tree for the crash matrices: a source, an artifact the build rewrites, a
    same-filesystem cache (renamed aside), a cross-filesystem one (tar
    snapshot) and a Python module."""
    write_tree(root, {"src/k.c": "int k(void) { return 4; }\n", "src/k.h": "int k(void);\n",
                      "build/k.so": "old artifact\n", "cache/a": "A\n", "cache/sub/b": "B\n",
                      "pkg/__init__.py": "", "pkg/m.py": "X = 1\n", "other.c": "int o;\n"})
    os.symlink("sub/b", os.path.join(root, "cache/link"))
    os.chmod(os.path.join(root, "build/k.so"), 0o755)
    os.link(os.path.join(root, "src/k.h"), os.path.join(root, "k-copy.h"))
    for name in ("src/k.c", "build/k.so", "pkg/m.py"):
        with contextlib.suppress(OSError):  # where the filesystem keeps user xattrs
            os.setxattr(os.path.join(root, name), "user.crash", b"kept")
    write_tree(other, {"x": "other cache\n", "d/y": "Y\n"})
    os.symlink("d/y", os.path.join(other, "ly"))
    past = time.time() - 3600
    for base in (root, other):
        for directory, dirs, files in os.walk(base, topdown=False):
            for name in files + dirs:
                os.utime(os.path.join(directory, name), (past, past), follow_symlinks=False)
            os.utime(directory, (past, past))


def shm_available() -> bool:
    return os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) and \
        os.stat("/dev/shm").st_dev != os.stat(tempfile.gettempdir()).st_dev


def forked_tool(args: list, env: dict = None, own: bool = False) -> subprocess.CompletedProcess:
    """run_tool without starting an interpreter: main() runs in a fork of this
    process, which a kill point or a signal ends as it would a run of the
    script.  The status is subprocess's: -N when signal N ended the run."""
    return forked_tools([args], env, own)[0]


def fork_tool(args: list, env: dict, own: bool, out: int, err: int) -> int:
    """Start forked_tool's run with its output to the descriptors out and
    err, and return its pid: the caller reaps it."""
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:  # the run: it never returns into the test runner
        status = 70
        try:
            os.dup2(out, 1)
            os.dup2(err, 2)
            sys.stdout = open(1, "w", closefd=False)
            sys.stderr = open(2, "w", closefd=False)
            os.environ.pop("OVERLAY_STATE", None)
            os.environ.update(env or {})
            status = overlay_setup.main(args + (["--owner-pid", str(os.getpid())] if own else []))
            sys.stdout.flush()
            sys.stderr.flush()
        except BaseException:
            with contextlib.suppress(BaseException):
                traceback.print_exc()
                sys.stderr.flush()
        finally:
            os._exit(status)
    return pid


def forked_tools(runs: list, env: dict = None, own: bool = False) -> list:
    """forked_tool for each argument list of `runs`, all running at once."""
    with contextlib.ExitStack() as files:
        started = []
        for args in runs:
            out, err = (files.enter_context(tempfile.TemporaryFile("w+")) for _ in range(2))
            started.append((args, fork_tool(args, env, own, out.fileno(), err.fileno()), out, err))
        done = []
        for args, pid, out, err in started:
            status = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
            out.seek(0)
            err.seek(0)
            done.append(subprocess.CompletedProcess(args, status, out.read(), err.read()))
        return done


def processes_working_in(root: str) -> list:
    """[(pid, command)] of the live processes whose working directory is `root`
    or below it: the build of a run, whether or not its pid was journaled."""
    found = []
    for name in os.listdir("/proc"):
        try:  # a zombie has no working directory
            cwd = os.readlink("/proc/%s/cwd" % name)
            if cwd == root or cwd.startswith(root + os.sep):
                found.append((int(name), read_text("/proc/%s/comm" % name).strip()))
        except (OSError, ValueError):
            continue
    return found


def wait_for_no_process_in(root: str) -> list:
    """Wait until no process works in `root`: what a build left running would
    write there, it has written once it ends.  [] then, or what still runs
    there after a minute, far more than any build of these tests takes."""
    deadline = time.monotonic() + 60
    while processes_working_in(root) and time.monotonic() < deadline:
        time.sleep(0.01)
    return processes_working_in(root)


# The crash matrices' builds first sleep $CRASH_BUILD_DELAY seconds (none
# unless set): a build that must be running when its run is killed takes real
# time, the others need not.
CRASH_BUILD_WAIT = 'sleep "${CRASH_BUILD_DELAY:-0}" && '


class CrashMatrixTest(unittest.TestCase):
    """SIGKILL at every mutation point, ENOSPC at every write: always recoverable,
    whole (content, mode, mtime, xattrs, link counts).  The second cache lives
    on another filesystem where there is one, so the tar snapshot path is
    crashed too.  Each run is a fork of this process (forked_tool)."""

    @classmethod
    def setUpClass(cls) -> None:
        # Each apply names the patch's .py file by running --python: a venv
        # without site-packages starts without this interpreter's .pth files.
        cls.venv = tempfile.mkdtemp(prefix="overlay-crash-venv-")
        cls.addClassCleanup(shutil.rmtree, cls.venv, True)
        subprocess.run([sys.executable, "-m", "venv", "--without-pip", cls.venv], check=True)

    def setUp(self) -> None:
        # The trees are on /dev/shm where that is another filesystem than the
        # temporary directory, which then holds the second cache: the matrix's
        # thousands of small files are not made on a disk, where ext4 without
        # a journal searches past every inode freed in the last minute or more.
        other = shm_available()
        self.tmp = tempfile.mkdtemp(prefix="overlay-crash-", dir="/dev/shm" if other else None)
        self.other_base = tempfile.mkdtemp(prefix="overlay-crash-", dir=None if other else self.tmp)
        self.addCleanup(shutil.rmtree, self.tmp, True)
        self.addCleanup(shutil.rmtree, self.other_base, True)
        self.round = 0

    def fresh(self) -> tuple:
        self.round += 1
        root = os.path.join(self.tmp, "r%d" % self.round, "tree")
        other = os.path.join(self.other_base, "r%d" % self.round)
        os.makedirs(os.path.dirname(root))
        crash_fixture(root, other)
        on_python_path(self, root)
        state = os.path.join(os.path.dirname(root), "state")
        return root, other, state, (full_tree(root), full_tree(other))

    def add_native_args(self, root: str, other: str, state: str) -> list:
        patched = os.path.join(os.path.dirname(root), "k_fast.c")
        write_tree(os.path.dirname(root), {"k_fast.c": "int k(void) { return 7; }\n"})
        return ["--state", state, "add-native", "--source", os.path.join(root, "src/k.c"),
                "--patched", patched, "--artifact", os.path.join(root, "build/k.so"),
                "--artifact", os.path.join(root, "build/new.so"),
                "--invalidate-cache", os.path.join(root, "cache"), "--invalidate-cache", other,
                "--build-cmd", CRASH_BUILD_WAIT + "cp src/k.c build/k.so && cp src/k.c build/new.so "
                               "&& mkdir -p cache && echo x > cache/fresh && echo t > stray.o",
                "--build-cwd", root]

    def apply_args(self, root: str, other: str, state: str) -> list:
        patch = os.path.join(os.path.dirname(root), "p.diff")
        write_tree(os.path.dirname(root), {"p.diff": (
            "--- a/src/k.c\n+++ b/src/k.c\n@@ -1 +1 @@\n-int k(void) { return 4; }\n"
            "+int k(void) { return 7; }\n"
            "--- a/src/k.h\n+++ /dev/null\n@@ -1 +0,0 @@\n-int k(void);\n"
            "--- /dev/null\n+++ b/src/new.c\n@@ -0,0 +1 @@\n+int n;\n"
            "--- a/pkg/m.py\n+++ b/pkg/m.py\n@@ -1 +1 @@\n-X = 1\n+X = 2\n")})
        return ["--state", state, "apply", patch, "--root", root,
                "--python", os.path.join(self.venv, "bin", "python"),
                "--artifact", os.path.join(root, "build/k.so"),
                "--invalidate-cache", os.path.join(root, "cache"), "--invalidate-cache", other,
                "--build-cmd", CRASH_BUILD_WAIT + "cp src/k.c build/k.so && echo t > stray.o",
                "--build-cwd", root]

    def assertRestored(self, root: str, other: str, expected: tuple, context: str) -> None:
        self.assertEqual((full_tree(root), full_tree(other)), expected, context)
        served = os.path.join(os.path.dirname(root), "state", "site", "overlay.json")
        if os.path.exists(served):
            self.assertFalse(read_json(served)["enabled"], "Python overlay still on: " + context)

    def kill_matrix(self, make_args) -> int:
        """SIGKILL at every point.  At the first point after the build was
        forked (its pid not yet journaled), SIGTERM, SIGHUP and SIGINT too:
        the run stops its build before it exits, and the late writes of a
        build left running must not land after the recovery (up to that point
        the builds sleep 0.3 s first, so that one would)."""
        point = 0
        window = None
        while True:
            point += 1
            self.assertLess(point, 300)
            root, other, state, expected = self.fresh()
            slow = {"CRASH_BUILD_DELAY": "0.3"} if window is None else {}
            result = forked_tool(make_args(root, other, state),
                                 dict(slow, OVERLAY_TEST_KILL_AT=str(point)), own=True)
            if result.returncode == 0:
                forked_tool(["--state", state, "revert"]).check_returncode()
                self.assertRestored(root, other, expected, "completed run")
                self.assertIsNotNone(window, "no kill point after the build started")
                return point
            self.assertEqual(result.returncode, -9, result.stderr)
            in_build = "building in" in result.stdout
            self.recover(root, other, state, expected, "killed at point %d" % point, in_build)
            if in_build and window is None:
                window = point
                for name in ("TERM", "HUP", "INT"):
                    root, other, state, expected = self.fresh()
                    result = forked_tool(make_args(root, other, state),
                                         dict(slow, OVERLAY_TEST_KILL_AT=str(point),
                                              OVERLAY_TEST_KILL_SIGNAL=name), own=True)
                    number = getattr(signal, "SIG" + name)
                    self.assertEqual(result.returncode, 128 + number, result.stderr)
                    self.assertEqual(processes_working_in(root), [],
                                     "the build outlived the run stopped by SIG" + name)
                    self.recover(root, other, state, expected, "SIG%s at point %d" % (name, point),
                                 True)

    def recover(self, root: str, other: str, state: str, expected: tuple, context: str,
                in_build: bool) -> None:
        gc = forked_tool(["gc-stale", "--root", os.path.dirname(root)])
        self.assertEqual(gc.returncode, 0, gc.stderr)
        if in_build:
            self.assertEqual(wait_for_no_process_in(root), [], "a build outlived gc-stale: " + context)
        self.assertRestored(root, other, expected, context)
        again = forked_tool(["--state", state, "revert"])
        self.assertEqual(again.returncode, 0, again.stderr)
        self.assertRestored(root, other, expected, "revert after gc, " + context)

    def enospc_matrix(self, make_args) -> int:
        write = 0
        while True:
            write += 1
            self.assertLess(write, 300)
            root, other, state, expected = self.fresh()
            result = forked_tool(make_args(root, other, state),
                                 {"OVERLAY_TEST_ENOSPC_AT": str(write)}, own=True)
            if result.returncode == 0:
                forked_tool(["--state", state, "revert"]).check_returncode()
                return write
            self.assertEqual(result.returncode, 1)
            # The first write is the state directory's own: E210, refused
            # before anything changed; any later one rolls back (E601).
            self.assertRegex(result.stderr, r"(?m)^overlay_setup: (E601 could not write|E210 "
                                            r"cannot write the state directory) .*"
                                            r"No space left on device")
            self.assertNotIn("Traceback", result.stderr)
            fixed = forked_tool(["--state", state, "revert"])
            self.assertEqual(fixed.returncode, 0, fixed.stderr)
            self.assertRestored(root, other, expected, "ENOSPC at write %d" % write)

    def test_kill_at_every_point_of_add_native_is_recovered_by_gc_stale(self) -> None:
        self.assertGreater(self.kill_matrix(self.add_native_args), 10)

    def test_kill_at_every_point_of_apply_is_recovered_by_gc_stale(self) -> None:
        self.assertGreater(self.kill_matrix(self.apply_args), 10)

    def test_kill_at_every_point_of_revert_is_recovered_by_gc_stale(self) -> None:
        point = 0
        while True:
            point += 1
            self.assertLess(point, 300)
            root, other, state, expected = self.fresh()
            forked_tool(self.apply_args(root, other, state), own=True).check_returncode()
            result = forked_tool(["--state", state, "revert"], {"OVERLAY_TEST_KILL_AT": str(point)})
            if result.returncode == 0:
                self.assertRestored(root, other, expected, "completed revert")
                break
            self.assertEqual(result.returncode, -9, result.stderr)
            gc = forked_tool(["gc-stale", "--root", os.path.dirname(root)])
            self.assertEqual(gc.returncode, 0, gc.stderr)
            self.assertRestored(root, other, expected, "revert killed at point %d" % point)
        self.assertGreater(point, 10)

    def test_no_space_at_every_write_of_add_native_and_apply_is_recoverable(self) -> None:
        self.assertGreater(self.enospc_matrix(self.add_native_args), 8)
        self.assertGreater(self.enospc_matrix(self.apply_args), 8)

    def test_no_space_at_every_write_of_revert_is_recoverable(self) -> None:
        write = 0
        while True:
            write += 1
            self.assertLess(write, 300)
            root, other, state, expected = self.fresh()
            forked_tool(self.add_native_args(root, other, state), own=True).check_returncode()
            result = forked_tool(["--state", state, "revert"], {"OVERLAY_TEST_ENOSPC_AT": str(write)})
            if result.returncode == 0:
                break
            self.assertEqual(result.stderr.count("\n"), 1, result.stderr)
            self.assertIn("(No space left on device) while reverting; the journal keeps what is "
                          "left: fix the cause and run `overlay_setup.py --state %s revert` again"
                          % state, result.stderr)
            forked_tool(["--state", state, "revert"]).check_returncode()
            self.assertRestored(root, other, expected, "revert ENOSPC at write %d" % write)
        self.assertGreater(write, 3)

class JournalDurabilityTest(OverlayTestCase):
    """The journal is on disk before the first byte of the install changes:
    written under a temporary name, fsynced, renamed over the old one, and
    its directory fsynced.  A SIGKILL keeps the page cache, so the crash
    matrix cannot see a missing fsync; the order of the calls can."""

    def setUp(self) -> None:
        super().setUp()
        self.proj = os.path.join(self.tmp, "proj")
        write_tree(self.proj, {"k.c": "int k;\n", "fast.c": "int k = 7;\n"})
        self.source = os.path.join(self.proj, "k.c")
        self.journal = os.path.join(self.state, "journal.json")

    def recorded(self, *argv: str) -> list:
        """Run the tool in-process and return its fsync and rename calls, in
        order: ("fsync", path), ("rename", source, target, the source's
        journal when the target is the journal)."""
        events = []
        real_fsync, real_replace, real_rename = os.fsync, os.replace, os.rename

        def where(name, dir_fd=None) -> str:
            name = os.fsdecode(name)
            return name if dir_fd is None else os.path.join(os.readlink("/proc/self/fd/%d" % dir_fd),
                                                            name)

        def fsync(fd):
            events.append(("fsync", os.readlink("/proc/self/fd/%d" % fd)))
            return real_fsync(fd)

        def renamer(real):
            def rename(src, dst, *, src_dir_fd=None, dst_dir_fd=None):
                source, target = where(src, src_dir_fd), where(dst, dst_dir_fd)
                events.append(("rename", source, target,
                               read_json(source) if target == self.journal else None))
                return real(src, dst, src_dir_fd=src_dir_fd, dst_dir_fd=dst_dir_fd)
            return rename

        real_link = os.link

        def link(src, dst, **kwargs):
            events.append(("link", os.fsdecode(src), os.fsdecode(dst)))
            return real_link(src, dst, **kwargs)

        with unittest.mock.patch.object(os, "fsync", fsync), \
                unittest.mock.patch.object(os, "replace", renamer(real_replace)), \
                unittest.mock.patch.object(os, "rename", renamer(real_rename)), \
                unittest.mock.patch.object(os, "link", link):
            self.assertOk(self.tool(*argv))
        return events

    def assertJournalWritesDurable(self, events: list) -> None:
        writes = [i for i, event in enumerate(events) if event[0] == "rename"
                  and event[2] == self.journal]
        self.assertTrue(writes)
        for i in writes:
            source = events[i][1]
            self.assertIn(("fsync", source), events[:i], "the journal was renamed into place "
                          "before its new content was fsynced")
            self.assertEqual([event for event in events[i + 1:] if event[0] == "fsync"][:1],
                             [("fsync", self.state)], "the state directory was not fsynced "
                             "right after the journal's rename")

    def first_change_of_the_source(self, events: list) -> int:
        return next(i for i, event in enumerate(events)
                    if event[0] == "rename" and event[2] == self.source)

    def last_journal_before(self, events: list, index: int) -> dict:
        return [event[3] for event in events[:index]
                if event[0] == "rename" and event[2] == self.journal][-1]

    def test_apply_journals_the_entry_durably_before_it_swaps_the_source(self) -> None:
        events = self.recorded("add-native", "--source", self.source, "--patched",
                               os.path.join(self.proj, "fast.c"), "--no-build")
        self.assertJournalWritesDurable(events)
        swap = self.first_change_of_the_source(events)
        journal = self.last_journal_before(events, swap)
        self.assertEqual([[record["path"] for record in entry["sources"]]
                          for entry in journal["entries"]], [[self.source]])
        self.assertEqual(journal["entries"][0]["state"], overlay_setup.NativeEntry.APPLYING)

    def test_a_claim_is_linked_into_place_and_its_directory_fsynced_once(self) -> None:
        # The claim's content is fsynced before the link; one fsync of the
        # directory after the link makes the link, and the removal of its
        # temporary name, durable: fsyncs of the directory before it guard
        # nothing a crash could lose.
        events = self.recorded("add-native", "--source", self.source, "--patched",
                               os.path.join(self.proj, "fast.c"), "--no-build")
        claim = overlay_setup.claim_path(self.source)
        made = next(i for i, event in enumerate(events)
                    if event[0] == "rename" and event[2] == overlay_setup.temp_beside(claim, "claim"))
        linked = events.index(("link", overlay_setup.temp_beside(claim, "claim"), claim))
        swap = self.first_change_of_the_source(events)
        self.assertEqual(events[made - 1][0], "fsync", "the claim's content was not fsynced")
        self.assertEqual([event for event in events[made:swap] if event == ("fsync", self.proj)],
                         [("fsync", self.proj)])
        self.assertIn(("fsync", self.proj), events[linked:swap])

    def test_revert_journals_that_it_began_before_it_restores_the_source(self) -> None:
        self.assertOk(self.tool("add-native", "--source", self.source, "--patched",
                                os.path.join(self.proj, "fast.c"), "--no-build"))
        events = self.recorded("revert")
        self.assertJournalWritesDurable(events)
        journal = self.last_journal_before(events, self.first_change_of_the_source(events))
        self.assertTrue(journal.get("reverting"))
        self.assertEqual(read_text(self.source), "int k;\n")


LIB_SOURCES = {
    "k.h": "#define K 4\nint a(void);\nint b(void);\n",
    "a.c": '#include "k.h"\nint a(void) { return 1; }\n',
    "b.c": '#include "k.h"\nint b(void) { return K; }\n',
}

# The builds of these projects sleep $TEST_BUILD_DELAY seconds (none unless
# it is set) before they link: kill_during_build sets it, so that its kill
# lands in a build that is still running.
MAKE_PROJECT = dict(LIB_SOURCES, Makefile=(
    "libk.so: a.o b.o\n"
    "\tsleep $${TEST_BUILD_DELAY:-0}\n"
    "\t$(CC) -shared -o $@ a.o b.o\n"
    "%.o: %.c k.h\n"
    "\t$(CC) -O1 -fPIC -MMD -c -o $@ $<\n"))

# An AMD GPU package as aiter and Composable Kernel ship them: .hip sources
# that hipcc compiles for gfx targets (no GPU needed to build), by make.
HIP_KERNEL = ("#include <hip/hip_runtime.h>\n#include \"k.h\"\n"
              "namespace { __global__ void scale(float* x) { x[threadIdx.x] *= K; } }\n"
              "extern \"C\" int %s(float* x) {\n"
              "    hipLaunchKernelGGL(scale, dim3(1), dim3(64), 0, 0, x);\n"
              "    return hipGetLastError() == hipSuccess ? 0 : 1;\n}\n")
HIP_PROJECT = {
    "k.h": "#define K 4\n",
    "a.hip": HIP_KERNEL % "a",
    "b.hip": HIP_KERNEL % "b",
    "Makefile": (
        "export HIP_PLATFORM = amd\n"
        "HIPCC ?= hipcc\n"
        "ARCH = --offload-arch=gfx90a --offload-arch=gfx1030\n"
        "libk.so: a.o b.o\n"
        "\tsleep $${TEST_BUILD_DELAY:-0}\n"
        "\t$(HIPCC) -shared $(ARCH) -o $@ a.o b.o\n"
        "%.o: %.hip k.h\n"
        "\t$(HIPCC) $(ARCH) -O1 -fPIC -c -o $@ $<\n"),
}


def hip_targets(library: str) -> set:
    """The gfx targets in a library's offload bundles, as check_contract.py's
    build tier reads them, and as clang-offload-bundler does where it is installed."""
    checker = test_check_contract.check_contract
    shared = checker.read_shared_object(library)
    targets = checker.hip_targets(shared)
    tool = test_check_contract.clang_offload_bundler()
    if tool is not None:
        assert test_check_contract.bundler_targets(shared, tool) == targets, library
    return targets


NINJA_PROJECT = dict(LIB_SOURCES, **{"build.ninja": (
    "rule cc\n"
    "  command = gcc -O1 -fPIC -MMD -MF $out.d -c $in -o $out\n"
    "  depfile = $out.d\n"
    "  deps = gcc\n"
    "rule link\n"
    "  command = sleep $${TEST_BUILD_DELAY:-0} && gcc -shared $in -o $out\n"
    "build a.o: cc a.c\n"
    "build b.o: cc b.c\n"
    "build libk.so: link a.o b.o\n")})

CMAKE_PROJECT = dict(LIB_SOURCES, **{"CMakeLists.txt": (
    "cmake_minimum_required(VERSION 3.13)\n"
    "project(k C)\n"
    "add_library(k SHARED a.c b.c)\n"
    "add_custom_command(TARGET k POST_BUILD COMMAND sh -c \"sleep \\${TEST_BUILD_DELAY:-0}\" "
    "VERBATIM)\n")})

EXTENSION_PROJECT = {
    "pkg/__init__.py": "",
    "pkg/_k.c": (
        "#include <Python.h>\n"
        "static PyObject *value(PyObject *self, PyObject *args) { return PyLong_FromLong(4); }\n"
        'static PyMethodDef methods[] = {{"value", value, METH_NOARGS, ""}, {NULL, NULL, 0, NULL}};\n'
        'static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_k", "", -1, methods};\n'
        "PyMODINIT_FUNC PyInit__k(void) { return PyModule_Create(&module); }\n"),
    "setup.py": ("from setuptools import setup, Extension\n"
                 'setup(name="pkg", version="0", packages=["pkg"],\n'
                 '      ext_modules=[Extension("pkg._k", ["pkg/_k.c"])])\n'),
}


def session_processes(sid: int) -> list:
    """[(pid, command)] of the live processes of session `sid`."""
    found = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open("/proc/%s/stat" % name, encoding="ascii", errors="replace") as handle:
                text = handle.read()
        except OSError:
            continue
        command = text[text.find("(") + 1:text.rfind(")")]
        fields = text[text.rfind(")") + 2:].split()
        if len(fields) > 3 and fields[3] == str(sid) and fields[0] != "Z":
            found.append((int(name), command))
    return found


def build_command_runs(sid: int) -> bool:
    """Whether a process other than a shell runs in the build's session."""
    return any(command != "sh" for _, command in session_processes(sid))


def age_tree(root: str) -> None:
    """Move every mtime under `root` an hour back, keeping their order: an
    install built a while ago (setuptools compares mtimes in whole seconds)."""
    for directory, dirs, files in os.walk(root, topdown=False):
        for path in [os.path.join(directory, name) for name in files] + [directory]:
            st = os.lstat(path)
            past = st.st_mtime_ns - 3600 * 10 ** 9
            os.utime(path, ns=(past, past), follow_symlinks=False)


def quiet(argv: list, cwd: str) -> subprocess.CompletedProcess:
    return subprocess.run(argv, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          universal_newlines=True)


def editable_venv(test_class: type, projects: dict) -> str:
    """A venv (sharing this interpreter's site-packages) with each project of
    `projects` ({directory: files}) written and installed with
    `pip install -e`; its python, or a skip naming why it cannot be had."""
    base = tempfile.mkdtemp(prefix="overlay-editable-")
    test_class.addClassCleanup(shutil.rmtree, base, True)
    venv = os.path.join(base, "venv")
    quiet([sys.executable, "-m", "venv", "--without-pip", "--system-site-packages", venv],
          base).check_returncode()
    python = os.path.join(venv, "bin", "python")
    # The projects are built by the venv's own setuptools, in one pip run:
    # pip's build isolation would install setuptools anew for each (seconds).
    editable = []
    for directory, files in sorted(projects.items()):
        write_tree(os.path.join(base, directory), files)
        editable += ["-e", directory]
    for args in (["--upgrade", "setuptools>=64"], ["--no-build-isolation"] + editable):
        done = quiet([python, "-m", "pip", "install", "-q"] + args, base)
        if done.returncode:
            raise unittest.SkipTest("pip cannot install a project editable in a venv here: "
                                    + (done.stdout.strip().splitlines() or ["no output"])[-1])
    return python


PYPROJECT = ('[build-system]\nrequires = ["setuptools>=64"]\n'
             'build-backend = "setuptools.build_meta"\n'
             '[project]\nname = "%s"\nversion = "0.1"\n')


class ModuleNameTest(OverlayTestCase):
    """A .py file of a patch is overlaid under the name Python imports it by:
    its package chain, a namespace package above it, an editable install's
    finder; and refused (E111) when that interpreter does not import it."""

    @classmethod
    def setUpClass(cls) -> None:
        # src layout: setuptools puts src/ on sys.path with a .pth file.  Flat
        # layout: it installs a finder that maps fpkg to its directory, so no
        # directory of the project is on sys.path.
        cls.python = editable_venv(cls, {
            "srcproj": {"pyproject.toml": PYPROJECT % "mypkg", "src/mypkg/__init__.py": "",
                        "src/mypkg/ops.py": "VALUE = 1\n"},
            "flatproj": {"pyproject.toml": PYPROJECT % "fpkg" + '[tool.setuptools]\n'
                                                         'packages = ["fpkg", "fpkg.sub"]\n',
                         "fpkg/__init__.py": "", "fpkg/sub/__init__.py": "",
                         "fpkg/sub/ops.py": "VALUE = 1\n", "fpkg/nsub/deep.py": "VALUE = 1\n"}})
        cls.base = os.path.dirname(os.path.dirname(os.path.dirname(cls.python)))

    def served(self, python: str, module: str) -> str:
        """VALUE of `module` in a fresh `python` started elsewhere with the overlay on."""
        env = json.loads(self.tool("env", "--json")[1])
        return subprocess.run([python, "-c", "import %s as m; print(m.VALUE)" % module],
                              env=dict(NO_BYTECODE, PYTHONPATH=env["PYTHONPATH"]), cwd=self.tmp,
                              stdout=subprocess.PIPE, universal_newlines=True,
                              check=True).stdout.strip()

    def test_src_layout_git_diff_from_the_project_root(self) -> None:
        proj = os.path.join(self.base, "srcproj")
        git = ["git", "-c", "user.name=t", "-c", "user.email=t@t", "-C", proj]
        quiet(git + ["init", "-q"], proj).check_returncode()
        quiet(git + ["add", "-A"], proj).check_returncode()
        quiet(git + ["commit", "-qm", "base"], proj).check_returncode()
        self.addCleanup(shutil.rmtree, os.path.join(proj, ".git"), True)
        write_tree(proj, {"src/mypkg/ops.py": "VALUE = 2\n"})
        write_text_file(os.path.join(self.tmp, "fix.diff"),
                        quiet(git + ["diff"], proj).stdout)
        quiet(git + ["checkout", "-q", "."], proj).check_returncode()
        before = tree_state(proj)
        # the tool run by the venv's python, from the project root, as a user would
        done = subprocess.run([self.python, TOOL, "--state", self.state, "apply",
                               os.path.join(self.tmp, "fix.diff"), "--no-build"], cwd=proj,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              universal_newlines=True)
        self.assertEqual((done.returncode, done.stderr), (0, ""))
        self.assertIn("1 Python module(s) overlaid (mypkg.ops)", done.stdout)
        self.assertEqual(self.served(self.python, "mypkg.ops"), "2")
        self.assertOk(self.tool("revert"))
        self.assertEqual(self.served(self.python, "mypkg.ops"), "1")
        self.assertEqual(tree_state(proj), before)

    def test_flat_layout_behind_an_editable_finder_patched_from_inside_the_package(self) -> None:
        package = os.path.join(self.base, "flatproj", "fpkg")
        write_text_file(os.path.join(self.tmp, "fix.diff"),
                        "--- sub/ops.py\n+++ sub/ops.py\n@@ -1 +1 @@\n-VALUE = 1\n+VALUE = 3\n"
                        "--- /dev/null\n+++ sub/fresh.py\n@@ -0,0 +1 @@\n+VALUE = 4\n"
                        # nsub has no __init__.py: a namespace package inside fpkg
                        "--- nsub/deep.py\n+++ nsub/deep.py\n@@ -1 +1 @@\n-VALUE = 1\n"
                        "+VALUE = 6\n")
        rc, out, err = self.tool("apply", os.path.join(self.tmp, "fix.diff"), "--root", package,
                                 "-p", "0", "--no-build", "--python", self.python)
        self.assertEqual((rc, err), (0, ""))
        self.assertIn("(fpkg.sub.ops, fpkg.sub.fresh, fpkg.nsub.deep)", out)
        self.assertEqual((self.served(self.python, "fpkg.sub.ops"),
                          self.served(self.python, "fpkg.sub.fresh"),
                          self.served(self.python, "fpkg.nsub.deep")), ("3", "4", "6"))
        self.assertOk(self.tool("revert"))
        self.assertEqual((self.served(self.python, "fpkg.sub.ops"),
                          self.served(self.python, "fpkg.nsub.deep")), ("1", "1"))
        self.assertFalse(os.path.exists(os.path.join(package, "sub", "fresh.py")))

    def test_namespace_package_across_two_sys_path_entries(self) -> None:
        # acme is a namespace package (no __init__.py) with a portion in each
        # directory; acme.plugins is one too, and only its parent is on sys.path
        write_tree(self.tmp, {"core/acme/core/__init__.py": "VALUE = 10\n",
                              "extra/acme/plugins/fast.py": "VALUE = 1\n"})
        on_python_path(self, os.pathsep.join([os.path.join(self.tmp, "core"),
                                              os.path.join(self.tmp, "extra")]))
        write_text_file(os.path.join(self.tmp, "fix.diff"),
                        "--- a/plugins/fast.py\n+++ b/plugins/fast.py\n@@ -1 +1 @@\n"
                        "-VALUE = 1\n+VALUE = 5\n")
        rc, out, err = self.tool("apply", os.path.join(self.tmp, "fix.diff"), "--root",
                                 os.path.join(self.tmp, "extra", "acme"), "--no-build")
        self.assertEqual((rc, err), (0, ""))
        self.assertIn("(acme.plugins.fast)", out)
        self.assertEqual((self.served(sys.executable, "acme.plugins.fast"),
                          self.served(sys.executable, "acme.core")), ("5", "10"))
        self.assertOk(self.tool("revert"))
        self.assertEqual(self.served(sys.executable, "acme.plugins.fast"), "1")

    def test_a_module_the_interpreter_does_not_import_is_refused_before_any_change(self) -> None:
        write_tree(self.tmp, {"proj/pkg/__init__.py": "", "proj/pkg/m.py": "VALUE = 1\n",
                              "proj/k.c": "int k;\n"})
        proj = os.path.join(self.tmp, "proj")
        write_text_file(os.path.join(self.tmp, "fix.diff"),
                        "--- a/k.c\n+++ b/k.c\n@@ -1 +1 @@\n-int k;\n+int k2;\n"
                        "--- a/pkg/m.py\n+++ b/pkg/m.py\n@@ -1 +1 @@\n-VALUE = 1\n+VALUE = 2\n")
        before = tree_state(self.tmp)
        # The current directory would make pkg importable to `python -c`, but not
        # to a program started elsewhere: it does not count.
        os.chdir(proj)
        self.assertEqual(self.tool("apply", os.path.join(self.tmp, "fix.diff"), "--no-build"), (
            1, "", "overlay_setup: E111 fix.diff: %s/pkg/m.py is module pkg.m, which %s cannot "
            "import (nor under a longer name of its path); put %s on PYTHONPATH or install its "
            "package, pass --python with the interpreter that runs it, or leave the file out of "
            "the patch (a test or a script); nothing was written\n"
            % (proj, sys.executable, proj)))
        self.assertEqual(tree_state(self.tmp), before)
        self.assertEqual(registry_entries(), [])

    def test_a_checkout_beside_the_installed_copy_is_refused(self) -> None:
        write_tree(self.tmp, {"site/pkg/__init__.py": "", "site/pkg/m.py": "VALUE = 1\n",
                              "checkout/pkg/__init__.py": "", "checkout/pkg/m.py": "VALUE = 1\n"})
        on_python_path(self, os.path.join(self.tmp, "site"))
        write_text_file(os.path.join(self.tmp, "fix.diff"),
                        "--- a/pkg/m.py\n+++ b/pkg/m.py\n@@ -1 +1 @@\n-VALUE = 1\n+VALUE = 2\n")
        checkout = os.path.join(self.tmp, "checkout")
        self.assertEqual(self.tool("apply", os.path.join(self.tmp, "fix.diff"), "--root",
                                   checkout, "--no-build"), (
            1, "", "overlay_setup: E111 fix.diff: {c}/pkg/m.py would be module pkg.m, but {p} "
            "imports pkg.m from {s}/pkg/m.py; patch that copy (--root at the install), "
            "install this one (pip install -e), or pass --python with the interpreter that "
            "imports this one; nothing was written\n".format(
                c=checkout, p=sys.executable, s=os.path.join(self.tmp, "site"))))
        self.assertFalse(os.path.exists(self.state))

    def test_another_copy_for_the_tool_s_python_names_the_python_flag(self) -> None:
        # The tool run by one python (the system's), the package installed
        # editable in a venv, and the tool's python importing another copy
        # (the system's own install of it, here a .pth file): --python
        # with the venv's interpreter is the fix, and the message says so.
        other = os.path.join(self.tmp, "other")
        write_tree(other, {"mypkg/__init__.py": "", "mypkg/ops.py": "VALUE = 1\n"})
        venv = os.path.join(self.tmp, "tool-venv")
        quiet([sys.executable, "-m", "venv", "--without-pip", venv], self.tmp).check_returncode()
        tool_python = os.path.join(venv, "bin", "python")
        site = quiet([tool_python, "-c", "import sysconfig; print(sysconfig.get_paths()"
                                         "['purelib'])"], self.tmp).stdout.strip()
        write_text_file(os.path.join(site, "other.pth"), other + "\n")
        proj = os.path.join(self.base, "srcproj")
        write_text_file(os.path.join(self.tmp, "fix.diff"),
                        "--- a/src/mypkg/ops.py\n+++ b/src/mypkg/ops.py\n@@ -1 +1 @@\n"
                        "-VALUE = 1\n+VALUE = 2\n")
        apply = [TOOL, "--state", self.state, "apply", os.path.join(self.tmp, "fix.diff"),
                 "--no-build"]
        done = subprocess.run([tool_python] + apply, cwd=proj, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, universal_newlines=True)
        self.assertEqual((done.returncode, done.stdout, done.stderr), (
            1, "", "overlay_setup: E111 fix.diff: {s}/mypkg/ops.py would be module mypkg.ops, "
            "but {p} imports mypkg.ops from {o}/mypkg/ops.py; patch that copy (--root at the "
            "install), install this one (pip install -e), or pass --python with the interpreter "
            "that imports this one; nothing was written\n".format(
                s=os.path.join(proj, "src"), p=tool_python, o=other)))
        done = subprocess.run([tool_python] + apply + ["--python", self.python], cwd=proj,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              universal_newlines=True)
        self.assertEqual((done.returncode, done.stderr), (0, ""))
        self.assertEqual(self.served(self.python, "mypkg.ops"), "2")
        self.assertOk(self.tool("revert"))

    def test_a_file_no_import_can_name_is_refused(self) -> None:
        write_tree(self.tmp, {"pkg/__init__.py": "", "pkg/my-ops.py": "VALUE = 1\n"})
        write_text_file(os.path.join(self.tmp, "fix.diff"), "--- a/pkg/my-ops.py\n"
                        "+++ b/pkg/my-ops.py\n@@ -1 +1 @@\n-VALUE = 1\n+VALUE = 2\n")
        self.assertEqual(self.tool("apply", os.path.join(self.tmp, "fix.diff"), "--root",
                                   self.tmp, "--no-build"), (
            2, "", "overlay_setup: E105 fix.diff: no import can name %s/pkg/my-ops.py (module "
            "'pkg.my-ops' is not a dotted name of identifiers); leave it out of the patch\n"
            % self.tmp))
        self.assertFalse(os.path.exists(self.state))

    def test_an_interpreter_that_cannot_run_is_one_line(self) -> None:
        write_tree(self.tmp, {"pkg/__init__.py": "", "pkg/m.py": "VALUE = 1\n"})
        write_text_file(os.path.join(self.tmp, "fix.diff"),
                        "--- a/pkg/m.py\n+++ b/pkg/m.py\n@@ -1 +1 @@\n-VALUE = 1\n+VALUE = 2\n")
        missing = os.path.join(self.tmp, "no-python")
        self.assertEqual(self.tool("apply", os.path.join(self.tmp, "fix.diff"), "--root",
                                   self.tmp, "--no-build", "--python", missing), (
            2, "", "overlay_setup: E102 cannot run --python %s (No such file or directory); "
            "pass the interpreter that runs the install\n" % missing))
        self.assertFalse(os.path.exists(self.state))


class RealBuildSystemTest(OverlayTestCase):
    maxDiff = None
    """The install's own build, as it comes: make, ninja, cmake and setuptools
    build_ext --inplace, with only the obvious flags.  Revert gives back the
    whole tree (build products and build-system state included) and the next
    incremental build has nothing to do; the same after the tool is killed
    during the build and gc-stale cleans up."""

    def project(self, files: dict) -> str:
        proj = os.path.join(self.tmp, "proj")
        write_tree(proj, files)
        return proj

    def round_trips(self, proj: str, source: str, patched_text: str, artifact: str,
                    build_cmd: str, build_cwd: str, no_work, noop_keeps_tree: bool = True) -> None:
        patched = os.path.join(self.tmp, "patched" + os.path.splitext(source)[1])
        write_text_file(patched, patched_text)
        args = ["add-native", "--source", source, "--patched", patched, "--artifact", artifact,
                "--build-cmd", build_cmd, "--build-cwd", build_cwd]
        age_tree(proj)
        before = tree_state(proj)
        original = overlay_setup.file_sha256(artifact)
        rc, out, err = self.tool(*args)
        self.assertEqual(rc, 0, err)
        self.assertNotIn("nothing backed up", err)  # files it made are no loss: revert removes them
        self.assertNotEqual(overlay_setup.file_sha256(artifact), original)
        rc, out, err = self.tool("revert")
        self.assertEqual((rc, err), (0, ""), out)
        self.assertEqual(tree_state(proj), before)
        self.assertTrue(no_work(), "the incremental build after revert is no no-op")
        if noop_keeps_tree:
            self.assertEqual(tree_state(proj), before)
        else:
            before = tree_state(proj)  # what the build's own no-op run left

        self.kill_during_build(args)
        rc, out, err = call("gc-stale", "--root", self.tmp)
        self.assertEqual(rc, 0, err)
        self.assertIn("): reverted\n", out)
        self.assertEqual(tree_state(proj), before)
        self.assertTrue(no_work(), "the incremental build after gc-stale is no no-op")
        if noop_keeps_tree:
            self.assertEqual(tree_state(proj), before)

    def make_round_trips(self, files: dict, build_cmd: str = "make",
                         artifact: str = "libk.so", under: str = "") -> None:
        """round_trips of a make project, built first as it comes: b.c (in
        the folder `under`) patched, and `make -q` there as the no-op test."""
        proj = self.project(files)
        quiet(["make"], proj).check_returncode()
        directory = os.path.join(proj, under) if under else proj
        self.round_trips(proj, os.path.join(directory, "b.c"),
                         LIB_SOURCES["b.c"].replace("K", "7"), os.path.join(directory, artifact),
                         build_cmd, proj,
                         lambda: quiet(["make", "-q"], directory).returncode == 0)

    def test_make(self) -> None:
        self.make_round_trips(MAKE_PROJECT)

    def test_make_with_jobs_from_the_shell(self) -> None:
        # `make -j$(nproc)`, as most people type it: make asked for its plan
        # must see what the shell gives the build, or it answers nothing and
        # the demo program it relinks goes without a backup.
        files = dict(LIB_SOURCES, **{"demo.c": "int b(void);\nint main(void) { return b(); }\n",
                                     "Makefile": MAKE_PROJECT["Makefile"].replace(
                                         "libk.so: a.o b.o\n",
                                         "all: libk.so demo\n"
                                         "demo: demo.o libk.so\n"
                                         "\t$(CC) -o $@ demo.o -L. -lk\n"
                                         "libk.so: a.o b.o\n")})
        self.make_round_trips(files, build_cmd="make -j$(nproc)")

    def test_a_build_that_refreshes_git_s_index_leaves_the_repository_alone(self) -> None:
        # A build that stamps its version with `git describe --dirty` (as
        # setuptools_scm and many CMake and make builds do) makes git rewrite
        # .git/index when a clean file's stat is stale: that is the
        # repository's, no build product, and revert must not remove it.
        files = dict(MAKE_PROJECT)
        files["Makefile"] = files["Makefile"].replace(
            "libk.so: a.o b.o\n", "libk.so: a.o b.o\n\tgit describe --always --dirty > /dev/null\n")
        proj = self.project(files)
        git = ["git", "-c", "user.name=t", "-c", "user.email=t@t", "-C", proj]
        quiet(git + ["init", "-q"], proj).check_returncode()
        quiet(git + ["add", "-A"], proj).check_returncode()
        quiet(git + ["commit", "-qm", "base"], proj).check_returncode()
        quiet(["make"], proj).check_returncode()
        age_tree(proj)  # every tracked file's stat is now stale in the index
        before = tree_state(proj)
        write_text_file(os.path.join(self.tmp, "fast.c"), LIB_SOURCES["b.c"].replace("K", "7"))
        rc, out, err = self.tool("add-native", "--source", os.path.join(proj, "b.c"), "--patched",
                                 os.path.join(self.tmp, "fast.c"), "--artifact",
                                 os.path.join(proj, "libk.so"), "--build-cmd", "make",
                                 "--build-cwd", proj)
        self.assertEqual(rc, 0, err)
        self.assertNotIn(".git", err)
        self.assertEqual(self.tool("revert")[::2], (0, ""))
        after = tree_state(proj)
        self.assertIn(".git/index", after)
        self.assertEqual({k: v for k, v in after.items() if k.split("/")[0] != ".git"},
                         {k: v for k, v in before.items() if k.split("/")[0] != ".git"})
        self.assertEqual(quiet(git + ["status", "--porcelain", "-uno"], proj).stdout, "")

    def test_recursive_make(self) -> None:
        # The top Makefile runs `$(MAKE) -C kernels`, whose rules name the
        # source as b.c, not kernels/b.c.
        files = {"kernels/" + name: text for name, text in MAKE_PROJECT.items()}
        files["Makefile"] = "all:\n\t$(MAKE) -C kernels\n"
        self.make_round_trips(files, under="kernels")

    @unittest.skipUnless(shutil.which("hipcc"), "hipcc is not installed (apt-get install "
                         "--no-install-recommends hipcc), so no HIP package can be built")
    def test_make_with_hipcc(self) -> None:
        # The patched kernel's code objects are in the library's offload
        # bundles: apply must change them, and revert give back every byte.
        # hipcc (clang's driver) leaves an empty folder in $TMPDIR per compile:
        # give it this test's.
        tempfile.gettempdir()  # this process's own temporary directory stays /tmp's
        scratch = os.path.join(self.tmp, "hipcc-tmp")
        os.mkdir(scratch)
        environment = unittest.mock.patch.dict(os.environ, TMPDIR=scratch)
        environment.start()
        self.addCleanup(environment.stop)
        proj = self.project(HIP_PROJECT)
        quiet(["make"], proj).check_returncode()
        library = os.path.join(proj, "libk.so")
        before = hip_targets(library)
        self.assertEqual(before, {"gfx90a", "gfx1030"})
        self.round_trips(proj, os.path.join(proj, "b.hip"),
                         HIP_KERNEL.replace("*= K", "*= K + 3.0f") % "b", library, "make", proj,
                         lambda: quiet(["make", "-q"], proj).returncode == 0)
        self.assertEqual(hip_targets(library), before)

    def test_ninja(self) -> None:
        proj = self.project(NINJA_PROJECT)
        quiet(["ninja"], proj).check_returncode()
        self.round_trips(proj, os.path.join(proj, "k.h"), LIB_SOURCES["k.h"].replace("4", "7"),
                         os.path.join(proj, "libk.so"), "ninja", proj,
                         lambda: "no work to do" in quiet(["ninja", "-n"], proj).stdout)

    def test_ninja_reading_depfiles_without_deps(self) -> None:
        # Without `deps = gcc` ninja reads the depfiles where the compiler left
        # them, and `ninja -t deps` knows nothing of k.h.
        files = dict(NINJA_PROJECT)
        files["build.ninja"] = files["build.ninja"].replace("  deps = gcc\n", "")
        proj = self.project(files)
        quiet(["ninja"], proj).check_returncode()
        self.round_trips(proj, os.path.join(proj, "k.h"), LIB_SOURCES["k.h"].replace("4", "7"),
                         os.path.join(proj, "libk.so"), "ninja", proj,
                         lambda: "no work to do" in quiet(["ninja", "-n"], proj).stdout)

    def test_jobs_of_a_ninja_that_died_are_stopped_before_gc_stale_reverts(self) -> None:
        # ninja runs each job in a process group of its own; when ninja itself
        # dies abruptly with the tool, its jobs go on writing into the tree.
        proj = self.project({"k.c": "int k;\n", "build.ninja": (
            "rule slow\n  command = sleep 1 && echo late > $out\n"
            "build late.o: slow k.c\n")})
        write_text_file(os.path.join(self.tmp, "fast.c"), "int k = 7;\n")
        age_tree(proj)
        before = tree_state(proj)
        self.kill_during_build(["add-native", "--source", os.path.join(proj, "k.c"), "--patched",
                                os.path.join(self.tmp, "fast.c"), "--build-cmd", "ninja",
                                "--build-cwd", proj])
        journal = read_json(os.path.join(self.state, "journal.json"))
        session = journal["entries"][0]["build"]["process"]["pid"]
        deadline = time.monotonic() + 60
        while True:  # the job runs: ninja and its sh
            running = {pid: command for pid, command in session_processes(session)}
            if "sleep" in running.values():
                break
            if time.monotonic() > deadline:
                self.fail("ninja's job never started: %s" % running)
            time.sleep(0.01)
        for pid, command in running.items():
            if command == "ninja":
                os.kill(pid, signal.SIGKILL)
        rc, out, err = call("gc-stale", "--root", self.tmp)
        self.assertEqual(rc, 0, err)
        deadline = time.monotonic() + 60  # a job left running writes late.o before it ends
        while session_processes(session) and time.monotonic() < deadline:
            time.sleep(0.01)
        self.assertEqual(session_processes(session), [])
        self.assertEqual(tree_state(proj), before)

    def cmake_ninja_round_trips(self, files: dict, artifact: str) -> None:
        """round_trips of a CMake project configured for Ninja in build/:
        a.c patched, `ninja -n` as the no-op test."""
        proj = self.project(files)
        build = os.path.join(proj, "build")
        quiet(["cmake", "-S", proj, "-B", build, "-G", "Ninja"], proj).check_returncode()
        quiet(["cmake", "--build", build], proj).check_returncode()
        self.round_trips(proj, os.path.join(proj, "a.c"), LIB_SOURCES["a.c"].replace("1", "2"),
                         os.path.join(build, artifact), "cmake --build build", proj,
                         lambda: "no work to do" in quiet(["ninja", "-n"], build).stdout)

    def test_cmake_with_ninja(self) -> None:
        self.cmake_ninja_round_trips(CMAKE_PROJECT, "libk.so")

    def test_cmake_with_makefiles(self) -> None:
        proj = self.project(CMAKE_PROJECT)
        build = os.path.join(proj, "build")
        quiet(["cmake", "-S", proj, "-B", build, "-G", "Unix Makefiles"], proj).check_returncode()
        quiet(["cmake", "--build", build], proj).check_returncode()
        self.round_trips(proj, os.path.join(proj, "k.h"), LIB_SOURCES["k.h"].replace("4", "7"),
                         os.path.join(build, "libk.so"), "cmake --build build", proj,
                         lambda: " -c " not in quiet(["make", "-n"], build).stdout)

    def test_make_linking_a_versioned_library_and_its_links(self) -> None:
        # As a configure-made Makefile (zlib's, zlib-ng's) links libz.so.1.2.3:
        # the recipe removes the links and makes them again, and no rule
        # names them, so `make -q` never remakes them if revert removed them.
        files = dict(LIB_SOURCES, Makefile=(
            "libk.so.1.0: a.o b.o\n"
            "\tsleep $${TEST_BUILD_DELAY:-0}\n"
            "\t$(CC) -shared -Wl,-soname,libk.so.1 -o $@ a.o b.o\n"
            "\trm -f libk.so libk.so.1\n"
            "\tln -s $@ libk.so\n"
            "\tln -s $@ libk.so.1\n"
            "%.o: %.c k.h\n"
            "\t$(CC) -O1 -fPIC -c -o $@ $<\n"))
        self.make_round_trips(files, artifact="libk.so.1.0")

    def test_cmake_shared_library_with_a_version_and_its_links(self) -> None:
        # VERSION and SOVERSION make CMake link libk.so.1.2.3 and make the
        # links libk.so.1 and libk.so anew at every link.
        files = dict(CMAKE_PROJECT)
        files["CMakeLists.txt"] += "set_target_properties(k PROPERTIES VERSION 1.2.3 SOVERSION 1)\n"
        self.cmake_ninja_round_trips(files, "libk.so.1.2.3")

    def test_cmake_build_directory_outside_the_build_cwd(self) -> None:
        # Run from the source directory, as `cmake --build ../build` is: the
        # build writes into ../build, where the library's links are made anew.
        files = {"src/" + name: text for name, text in CMAKE_PROJECT.items()}
        files["src/CMakeLists.txt"] += "set_target_properties(k PROPERTIES VERSION 1.2.3 SOVERSION 1)\n"
        proj = self.project(files)
        src, build = os.path.join(proj, "src"), os.path.join(proj, "build")
        quiet(["cmake", "-S", src, "-B", build, "-G", "Ninja"], proj).check_returncode()
        quiet(["cmake", "--build", build], proj).check_returncode()
        self.round_trips(proj, os.path.join(src, "a.c"), LIB_SOURCES["a.c"].replace("1", "2"),
                         os.path.join(build, "libk.so.1.2.3"), "cmake --build ../build", src,
                         lambda: "no work to do" in quiet(["ninja", "-n"], build).stdout)
        # trial's check of the install covers that build directory too
        before = tree_state(proj)
        write_text_file(os.path.join(self.tmp, "a.diff"),
                        "--- a/a.c\n+++ b/a.c\n@@ -2 +2 @@\n-int a(void) { return 1; }\n"
                        "+int a(void) { return 2; }\n")
        done = run_tool(["--state", self.state, "trial", os.path.join(self.tmp, "a.diff"),
                         "--root", src, "--artifact", os.path.join(build, "libk.so.1.2.3"),
                         "--build-cmd", "cmake --build ../build", "--", "true"], cwd=src)
        self.assertEqual(done.returncode, 0, done.stdout + done.stderr)
        self.assertIn("revert: the install is byte-identical to before", done.stdout)
        self.assertEqual(tree_state(proj), before)

    def test_jit_build_beside_the_artifact_that_runs_after_a_no_build_apply(self) -> None:
        # torch.utils.cpp_extension.load's layout: the sources stay where they
        # are, a build.ninja in the extension's cache folder names them by
        # absolute path, and ninja runs there at import, after `--no-build`.
        proj = self.project(LIB_SOURCES)
        cache = os.path.join(self.tmp, "torch_extensions", "py311_cu130", "k")
        write_tree(cache, {"build.ninja": (
            "ninja_required_version = 1.3\ncxx = gcc\n"
            "cflags = -DTORCH_EXTENSION_NAME=k -fPIC -O1\nldflags = -shared\n"
            "rule compile\n  command = $cxx -MMD -MF $out.d $cflags -c $in -o $out\n"
            "  depfile = $out.d\n  deps = gcc\n"
            "rule link\n  command = $cxx $in $ldflags -o $out\n"
            "build a.o: compile %s/a.c\nbuild b.o: compile %s/b.c\n"
            "build k.so: link a.o b.o\ndefault k.so\n" % (proj, proj))})
        jit = lambda: quiet(["ninja"], cache)  # noqa: E731 (what the import runs)
        jit().check_returncode()
        age_tree(self.tmp)
        extensions = os.path.join(self.tmp, "torch_extensions")
        before = (tree_state(proj), tree_state(extensions))
        patched = os.path.join(self.tmp, "patched.h")
        write_text_file(patched, LIB_SOURCES["k.h"].replace("4", "7"))
        args = ["add-native", "--source", os.path.join(proj, "k.h"), "--patched", patched,
                "--artifact", os.path.join(cache, "k.so"), "--no-build"]
        rc, out, err = self.tool(*args, "--dry-run")
        self.assertEqual((rc, err), (0, ""))
        self.assertIn("  back up    %s/b.o (build product, predicted from ninja's graph)\n"
                      "  back up    %s/.ninja_log (build product" % (cache, cache), out)
        self.assertIn("  build      none (--no-build: a later build, such as a JIT at import, "
                      "rebuilds; then `overlay_setup.py --state %s verify-native`)\n"
                      % self.state, out)
        self.assertEqual((tree_state(proj), tree_state(extensions)), before)
        rc, out, err = self.tool(*args)
        self.assertEqual((rc, err), (0, ""))
        self.assertEqual(self.tool("verify-native"), (
            1, "", "overlay_setup: E403 artifact %s/k.so is unchanged since the apply: the build "
            "that rebuilds it (a JIT at import) has not run yet, or did not see the patch\n"
            % cache))
        jit().check_returncode()
        self.assertEqual(self.tool("verify-native"),
                         (0, "1 artifact(s) rebuilt from the patched sources\n", ""))
        self.assertOk(self.tool("revert"))
        self.assertEqual((tree_state(proj), tree_state(extensions)), before)
        self.assertIn("no work to do", quiet(["ninja", "-n"], cache).stdout)

    def setuptools_python(self) -> str:
        """The python of a venv that has setuptools, or a skip saying why not.
        One venv serves the whole class: the tests build in their own trees."""
        if "setuptools_venv" not in type(self).__dict__:
            base = tempfile.mkdtemp(prefix="overlay-setuptools-")
            type(self).addClassCleanup(shutil.rmtree, base, True)
            venv = os.path.join(base, "venv")
            quiet([sys.executable, "-m", "venv", "--without-pip", "--system-site-packages", venv],
                  base).check_returncode()
            python = os.path.join(venv, "bin", "python")
            if quiet([python, "-c", "import setuptools"], base).returncode != 0:
                quiet([python, "-m", "ensurepip"], base)
                if quiet([python, "-m", "pip", "install", "-q", "setuptools"], base).returncode:
                    python = None
            type(self).setuptools_venv = python
        if type(self).setuptools_venv is None:
            self.skipTest("setuptools is neither importable nor installable in a venv here")
        return type(self).setuptools_venv

    def test_setuptools_extension_that_falls_back_when_it_does_not_compile(self) -> None:
        # As markupsafe's setup.py does for its speedups: a compile error is
        # caught and the package installs without the extension, exit 0.  The
        # messages lead to `update`, which builds the fixed patch in place.
        files = dict(EXTENSION_PROJECT)
        files["setup.py"] = (
            "from setuptools import setup, Extension\n"
            "from setuptools.command.build_ext import build_ext\n"
            "class optional_build_ext(build_ext):\n"
            "    def build_extension(self, ext):\n"
            "        try:\n"
            "            super().build_extension(ext)\n"
            "        except Exception as exc:\n"
            "            print('no speedups:', exc)\n"
            'setup(name="pkg", version="0", packages=["pkg"], cmdclass={"build_ext": '
            "optional_build_ext},\n"
            '      ext_modules=[Extension("pkg._k", ["pkg/_k.c"])])\n')
        proj = self.project(files)
        python = self.setuptools_python()
        build = " ".join([python, "setup.py", "build_ext", "--inplace"])
        quiet(build.split(), proj).check_returncode()
        age_tree(proj)
        before = tree_state(proj)
        library = [name for name in os.listdir(os.path.join(proj, "pkg")) if name.endswith(".so")]
        args = ["--artifact", os.path.join(proj, "pkg", library[0]), "--build-cmd", build,
                "--build-cwd", proj]
        source = os.path.join(proj, "pkg", "_k.c")
        broken = os.path.join(self.tmp, "broken.c")
        write_text_file(broken, EXTENSION_PROJECT["pkg/_k.c"].replace("(4)", "(7"))
        rc, out, err = self.tool("add-native", "--source", source, "--patched", broken, *args)
        self.assertEqual(rc, 1, out)
        self.assertIn("fix the patch or the source and run `overlay_setup.py --state %s update`"
                      % self.state, err)
        fixed = os.path.join(self.tmp, "fixed.c")
        write_text_file(fixed, EXTENSION_PROJECT["pkg/_k.c"].replace("(4)", "(7)"))
        rc, out, err = self.tool("update", "--patched", fixed)
        self.assertEqual(rc, 0, err)
        self.assertOk(self.tool("verify-native"))
        self.assertOk(self.tool("revert"))
        self.assertEqual(tree_state(proj), before)

    def test_setuptools_header_patch_names_build_ext_force(self) -> None:
        # build_ext rebuilds an extension when a file of its sources or its
        # depends= changed, not for a header it includes (ujson, most C
        # extensions): the no-op build's message says what to run instead.
        files = dict(EXTENSION_PROJECT)
        files["pkg/_k.h"] = "#define VALUE 4\n"
        files["pkg/_k.c"] = files["pkg/_k.c"].replace(
            "#include <Python.h>\n", '#include <Python.h>\n#include "_k.h"\n').replace(
            "PyLong_FromLong(4)", "PyLong_FromLong(VALUE)")
        proj = self.project(files)
        python = self.setuptools_python()
        build = "%s setup.py build_ext --inplace" % python
        quiet(build.split(), proj).check_returncode()
        age_tree(proj)
        before = tree_state(proj)
        library = [name for name in os.listdir(os.path.join(proj, "pkg")) if name.endswith(".so")]
        patched = os.path.join(self.tmp, "patched.h")
        write_text_file(patched, "#define VALUE 7\n")
        args = ["add-native", "--source", os.path.join(proj, "pkg", "_k.h"), "--patched",
                patched, "--artifact", os.path.join(proj, "pkg", library[0]), "--build-cwd", proj]
        rc, out, err = self.tool(*args, "--build-cmd", build)
        self.assertEqual(rc, 1, out)
        self.assertIn("it stays applied for inspection: setuptools' build_ext rebuilds an "
                      "extension when one of its sources changed, not for a header it includes: "
                      "run `overlay_setup.py --state %s revert`, then apply again with "
                      "--build-cmd '%s --force'\n" % (self.state, build), err)
        self.assertOk(self.tool("revert"))
        self.assertEqual(tree_state(proj), before)
        rc, out, err = self.tool(*args, "--build-cmd", build + " --force")
        self.assertEqual(rc, 0, err)
        self.assertOk(self.tool("revert"))
        self.assertEqual(tree_state(proj), before)

    def test_a_version_file_every_build_writes_comes_back_byte_exact(self) -> None:
        # setuptools_scm's version_file and torch's setup.py write the
        # package's _version.py on every build, with the same content: it is
        # no compiled output, and revert must not delete it (`import pkg`
        # would fail until the next build) but put back the copy taken before
        # the build, mtime included.
        files = dict(EXTENSION_PROJECT)
        files["setup.py"] = ("open('pkg/_version.py', 'w').write('version = \"1.0\"\\n')\n"
                             + files["setup.py"])
        files["pkg/__init__.py"] = "from ._version import version\n"
        proj = self.project(files)
        python = self.setuptools_python()
        build = [python, "setup.py", "build_ext", "--inplace"]
        quiet(build, proj).check_returncode()
        age_tree(proj)
        before = tree_state(proj)
        library = [name for name in os.listdir(os.path.join(proj, "pkg")) if name.endswith(".so")]
        patched = os.path.join(self.tmp, "fast.c")
        write_text_file(patched, EXTENSION_PROJECT["pkg/_k.c"].replace("(4)", "(7)"))
        rc, out, err = self.tool("add-native", "--source", os.path.join(proj, "pkg", "_k.c"),
                                 "--patched", patched, "--artifact",
                                 os.path.join(proj, "pkg", library[0]), "--build-cmd",
                                 " ".join(build), "--build-cwd", proj)
        self.assertEqual(rc, 0, err)
        version = os.path.join(proj, "pkg", "_version.py")
        self.assertIn("the build rewrote or deleted %s; revert puts back the copies taken "
                      "before it\n" % shown(version), out)
        rc, out, err = self.tool("revert")
        self.assertEqual((rc, err), (0, ""))
        self.assertEqual(tree_state(proj), before)
        self.assertEqual(quiet([python, "-c", "import pkg; print(pkg.version)"], proj).stdout,
                         "1.0\n")

    def test_setuptools_build_ext_inplace(self) -> None:
        proj = self.project(EXTENSION_PROJECT)
        python = self.setuptools_python()
        build = [python, "setup.py", "build_ext", "--inplace"]
        quiet(build, proj).check_returncode()
        suffix = quiet([python, "-c", "import sysconfig; print(sysconfig.get_config_var("
                                      "'EXT_SUFFIX'))"], proj).stdout.strip()
        self.round_trips(proj, os.path.join(proj, "pkg", "_k.c"),
                         EXTENSION_PROJECT["pkg/_k.c"].replace("(4)", "(7)"),
                         os.path.join(proj, "pkg", "_k" + suffix),
                         " ".join(build), proj,
                         lambda: " -c pkg/_k.c " not in quiet(build, proj).stdout,
                         # distutils' build_ext (setuptools < 60) copies the in-place library
                         # again on every run, even when it compiles nothing
                         noop_keeps_tree=self.setuptools_major(python) >= 60)

    def setuptools_major(self, python: str) -> int:
        version = quiet([python, "-c", "import setuptools; print(setuptools.__version__)"],
                        self.tmp).stdout
        return int(version.split(".")[0])


# How the --dry-run plan of a make build in {p} ends: make is not asked.
MAKE_PLAN_END = (
    "  back up    the build products make -n -W names (not asked by --dry-run: make "
    "evaluates the Makefile's $(shell ...) to answer; a real run asks once its journal "
    "is written)\n"
    "  back up    the small files of {p} that are no build product (up to 256 KiB "
    "each, 500 files and 16 MiB in all; dropped after the build for each file it left "
    "alone)\n"
    "  build      make (in {p})\n")


class ProtectTest(OverlayTestCase):
    """What the build will rewrite is backed up, planned, bounded and reported."""

    def setUp(self) -> None:
        super().setUp()
        self.proj = self.built_project(MAKE_PROJECT)
        self.patched = os.path.join(self.tmp, "b_fast.c")
        write_text_file(self.patched, LIB_SOURCES["b.c"].replace("K", "7"))

    def p(self, relative: str) -> str:
        return os.path.join(self.proj, relative)

    def add(self, *extra: str) -> tuple:
        return self.tool("add-native", "--source", self.p("b.c"), "--patched", self.patched,
                         "--artifact", self.p("libk.so"), "--build-cmd", "make",
                         "--build-cwd", self.proj, *extra)

    def test_dry_run_prints_the_plan_and_changes_nothing(self) -> None:
        before = tree_state(self.proj)
        self.assertEqual(self.add("--dry-run"), (0, (
            "plan (--dry-run: nothing was changed):\n"
            "  patch      {p}/b.c\n"
            "  back up    {p}/b.c (source)\n"
            "  back up    {p}/libk.so (artifact)\n"
            + MAKE_PLAN_END).format(p=self.proj), ""))
        self.assertEqual(tree_state(self.proj), before)
        self.assertFalse(os.path.exists(self.state))

    def test_the_build_products_the_dry_run_lists_are_those_the_apply_backs_up(self) -> None:
        # One plan for both: a build that is no plain make call (here a
        # script running make) gets the object files and libraries found in
        # the build directory, and --protect its own file.
        options = ("--build-cmd", "sh -c make", "--protect", self.p("Makefile"))
        rc, out, err = self.add(*options, "--dry-run")
        self.assertEqual((rc, err), (0, ""))
        listed = [line.split()[2] for line in out.splitlines() if "(build product, " in line]
        self.assertEqual(sorted(listed), [self.p(name) for name in (
            "Makefile", "a.d", "a.o", "b.d", "b.o")])
        self.assertOk(self.add(*options))
        journal = read_json(os.path.join(self.state, "journal.json"))
        self.assertEqual([record["path"] for record in journal["entries"][0]["protected"]
                          if record["role"] == "build product"], listed)
        self.assertOk(self.tool("revert"))

    def test_dry_run_runs_no_command_substitution_of_a_script_build(self) -> None:
        # Only a make, ninja or cmake command is read with the shell's
        # expansions (to ask it for its plan); a script's are the script's.
        before = tree_state(self.proj)
        rc, out, err = self.tool("add-native", "--source", self.p("b.c"), "--patched",
                                 self.patched, "--build-cmd", "sh build.sh $(touch marker)",
                                 "--build-cwd", self.proj, "--dry-run")
        self.assertEqual((rc, err), (0, ""))
        self.assertEqual(tree_state(self.proj), before)

    def test_dry_run_of_a_make_command_runs_nothing_of_it(self) -> None:
        # The plan of `make -j$(nproc)` is asked of make itself, but no part
        # of the command line runs before the build does: not a substitution,
        # not a command chained inside a word.
        before = tree_state(self.proj)
        for command in ("make -j$(touch marker1)", "make -j$(nproc);touch marker2",
                        "make -j`nproc`&&touch marker3", "make -C \"$(touch marker4; pwd)\""):
            rc, out, err = self.tool("add-native", "--source", self.p("b.c"), "--patched",
                                     self.patched, "--build-cmd", command, "--build-cwd",
                                     self.proj, "--dry-run")
            self.assertEqual((rc, err), (0, "") if "marker4" not in command else (
                1, "overlay_setup: E123 cannot tell where the build command writes: `make -C "
                "$(...)` names a directory only the shell knows; nothing was changed: pass "
                "--build-dir DIR for each directory it writes in (repeatable)\n"), command)
            self.assertEqual(tree_state(self.proj), before, command)

    def test_apply_dry_run_shows_natives_and_python_modules(self) -> None:
        write_tree(self.proj, {"pkg/__init__.py": "", "pkg/m.py": "X = 1\n"})
        on_python_path(self, self.proj)
        patch = os.path.join(self.tmp, "p.diff")
        write_text_file(patch, "--- a/b.c\n+++ b/b.c\n@@ -2 +2 @@\n-int b(void) { return K; }\n"
                               "+int b(void) { return 7; }\n"
                               "--- a/pkg/m.py\n+++ b/pkg/m.py\n@@ -1 +1 @@\n-X = 1\n+X = 2\n")
        before = tree_state(self.proj)
        rc, out, err = self.tool("apply", patch, "--root", self.proj, "--dry-run",
                                 "--build-cmd", "make", "--build-cwd", self.proj)
        self.assertEqual((rc, err), (0, "warning: no --artifact given; verify-native will have "
                                        "nothing to check\n"))
        self.assertEqual(out, (
            "plan (--dry-run: nothing was changed):\n"
            "  patch      {p}/b.c\n"
            "  overlay    module pkg.m from {p}/pkg/m.py (Python overlay)\n"
            "  back up    {p}/b.c (source)\n"
            + MAKE_PLAN_END).format(p=self.proj))
        self.assertEqual(tree_state(self.proj), before)
        self.assertFalse(os.path.exists(self.state))

    def test_dry_run_without_a_build_command_suggests_what_it_finds(self) -> None:
        base = os.path.join(self.tmp, "install")
        write_tree(base, {"setup.py": "", "Makefile": "all:\n\ttouch ran\n",
                          "build/CMakeCache.txt": "CMAKE_GENERATOR:INTERNAL=Ninja\n",
                          "build/build.ninja": "", "csrc/ops/k.cu": "int k;\n",
                          "torch-ext/x": ""})
        os.environ["TORCH_EXTENSIONS_DIR"] = os.path.join(base, "torch-ext")
        self.addCleanup(os.environ.pop, "TORCH_EXTENSIONS_DIR")
        before = tree_state(base)
        rc, out, err = self.tool("add-native", "--source", os.path.join(base, "csrc/ops/k.cu"),
                                 "--patched", self.patched, "--dry-run")
        self.assertEqual((rc, err), (0, ""))
        self.assertTrue(out.startswith(
            "plan (--dry-run: nothing was changed):\n"
            "  patch      {b}/csrc/ops/k.cu\n"
            "  back up    {b}/csrc/ops/k.cu (source)\n"
            "  build      none given; found near {b}/csrc/ops/k.cu (suggestions, never run by "
            "themselves):\n"
            "    --build-cmd make --build-cwd {b}  ({b}/Makefile)\n"
            "    --build-cmd 'cmake --build {b}/build' --build-cwd {b}/build  "
            "({b}/build/CMakeCache.txt)\n"
            "    --build-cmd ninja --build-cwd {b}/build  ({b}/build/build.ninja)\n"
            "    --build-cmd 'python3 setup.py build_ext --inplace' --build-cwd {b}  "
            "({b}/setup.py)\n".format(b=base)), out)
        self.assertIn("    --invalidate-cache {b}/torch-ext  (torch extension build cache)\n"
                      .format(b=base), out)
        self.assertEqual(tree_state(base), before)
        self.assertFalse(os.path.exists(self.state))

    def test_products_over_the_budget_are_refused_before_anything_changes(self) -> None:
        big = self.p("build/big.o")
        os.makedirs(os.path.dirname(big))
        with open(big, "wb") as handle:  # sparse: its size costs no disk
            handle.truncate(overlay_setup.PROTECT_BUDGET + (1 << 20))
        source = read_text(self.p("b.c"))
        rc, out, err = self.tool("add-native", "--source", self.p("b.c"), "--patched",
                                 self.patched, "--artifact", self.p("libk.so"),
                                 "--build-cmd", "make && true", "--build-cwd", self.proj)
        self.assertEqual((rc, out), (1, ""))
        self.assertEqual(err, "overlay_setup: E110 backing up the 5 existing build product(s) the "
                              "build may rewrite (found in the build directory) takes 1025 MiB, "
                              "over the budget of 1024 MiB; nothing was changed: pass "
                              "--no-protect to accept that revert leaves them rebuilt, with "
                              "--protect PATH for those to keep byte-exact\n")
        self.assertEqual(read_text(self.p("b.c")), source)
        self.assertFalse(os.path.exists(self.state))
        rc, out, err = self.tool("add-native", "--source", self.p("b.c"), "--patched",
                                 self.patched, "--artifact", self.p("libk.so"),
                                 "--build-cmd", "make && true", "--build-cwd", self.proj,
                                 "--no-protect",
                                 "--protect", self.p("b.o"), "--protect", self.p("b.d"))
        self.assertEqual((rc, err), (0, ""))
        self.assertIn("backed up 2 build product(s) the build may rewrite: proj/b.o (--protect), "
                      "proj/b.d (--protect)\n", out)  # relative to the current directory
        self.assertEqual(self.tool("revert")[0], 0)
        self.assertEqual(read_text(self.p("b.c")), source)

    def test_a_header_many_objects_include_is_summed_up_in_one_short_line(self) -> None:
        objects = ["f%d.o" % number for number in range(1, 8)]
        write_tree(self.tmp, dict(
            {"many/k.h": "#define K 4\n", "many/Makefile": (
                "libk.so: %s\n\t$(CC) -shared -o $@ $^\n%%.o: %%.c k.h\n"
                "\t$(CC) -fPIC -c -o $@ $<\n" % " ".join(objects)), "k_fast.h": "#define K 5\n"},
            **{"many/" + name[:-2] + ".c": '#include "k.h"\nint %s(void) { return K; }\n'
               % name[:-2] for name in objects}))
        many = os.path.join(self.tmp, "many")
        quiet(["make"], many).check_returncode()
        rc, out, err = self.tool("add-native", "--source", os.path.join(many, "k.h"), "--patched",
                                 os.path.join(self.tmp, "k_fast.h"), "--artifact",
                                 os.path.join(many, "libk.so"), "--build-cmd", "make",
                                 "--build-cwd", many)
        self.assertEqual((rc, err), (0, ""))
        self.assertIn("backed up 7 build product(s) the build may rewrite: %s, and 3 more "
                      "(`status` lists them)\n" % ", ".join(
                          "many/%s (predicted by make -n -W)" % name for name in objects[:4]), out)
        listed = self.tool("status")[1]
        self.assertEqual([name for name in objects if "build product %s/%s\n" % (many, name)
                          in listed], objects)
        self.assertOk(self.tool("revert"))

    def test_a_rewrite_nothing_backed_up_by_a_killed_run_is_named_by_gc_stale(self) -> None:
        original = overlay_setup.file_sha256(self.p("libk.so"))
        self.kill_during_build(["add-native", "--source", self.p("b.c"), "--patched", self.patched,
                                "--artifact", self.p("libk.so"), "--build-cmd", "make -s",
                                "--build-cwd", self.proj, "--no-protect"])
        deadline = time.monotonic() + 60  # a silent build goes on without the tool
        while overlay_setup.file_sha256(self.p("libk.so")) == original:
            if time.monotonic() > deadline:
                self.fail("the build left running never relinked libk.so")
            time.sleep(0.02)
        rc, out, err = call("gc-stale", "--root", self.tmp)
        self.assertEqual(rc, overlay_setup.NOT_EXACT, err)
        self.assertTrue(err.endswith(
            "overlay_setup: E506 not byte-exact: the build rewrote {0}, {1} with no backup; the "
            "next build makes them again (to keep them next time, pass --protect {0} --protect "
            "{1})\n".format(self.p("b.d"), self.p("b.o"))), err)
        self.assertEqual(overlay_setup.file_sha256(self.p("libk.so")), original)

    def test_protect_needs_an_existing_file_or_directory(self) -> None:
        os.symlink("b.o", self.p("link.o"))
        before = tree_state(self.proj)
        self.assertEqual(self.add("--protect", self.p("gone.o")), (
            1, "", "overlay_setup: E102 --protect %s does not exist; pass an existing build "
            "product or a directory of them\n" % self.p("gone.o")))
        self.assertEqual(self.add("--protect", self.p("link.o")), (
            1, "", "overlay_setup: E104 --protect %s is a symlink or special file; pass the file "
            "or directory itself\n" % self.p("link.o")))
        self.assertEqual(tree_state(self.proj), before)

    def test_a_rewrite_nothing_backed_up_is_named_at_once_and_revert_exits_3(self) -> None:
        before = tree_state(self.proj)
        rc, out, err = self.add("--no-protect", "--protect", self.p("b.o"))
        self.assertEqual(rc, 0)
        self.assertEqual(err, "warning: the build rewrote files that nothing backed up, so revert "
                              "cannot give them back byte-exact (it removes them, the next build "
                              "makes them again): {0}; next time pass --protect {0}\n"
                              .format(self.p("b.d")))
        rc, out, err = self.tool("revert")
        self.assertEqual((rc, out), (overlay_setup.NOT_EXACT,
                                     "entry 1 restored: %s\n%sreverted %s\n"
                                     % (shown(self.p("b.c")), checked(self.proj), self.state)))
        self.assertEqual(err, "overlay_setup: E506 not byte-exact: the build rewrote {0} with no "
                              "backup; the next build makes it again (to keep it next time, pass "
                              "--protect {0})\n".format(self.p("b.d")))
        after = tree_state(self.proj)
        self.assertNotIn("b.d", after)
        after["b.d"] = before["b.d"]
        self.assertEqual(after, before)


class GcStaleTest(OverlayTestCase):
    def setUp(self) -> None:
        super().setUp()
        self.proj = os.path.join(self.tmp, "proj")
        write_tree(self.proj, {"k.c": "int k;\n", "fast.c": "int k = 7;\n"})
        self.original = tree_state(self.proj)

    def apply(self, owner: int = None) -> subprocess.CompletedProcess:
        args = ["--state", self.state, "add-native", "--source", os.path.join(self.proj, "k.c"),
                "--patched", os.path.join(self.proj, "fast.c"), "--no-build"]
        if owner is None:
            return forked_tool(args, own=True)
        return forked_tool(args + ["--owner-pid", str(owner)])

    def test_default_owner_is_the_session_so_timeout_and_a_shell_per_command_survive(self) -> None:
        # An agent starting each command in a fresh shell under `timeout`:
        # the shell and `timeout` exit at once, the agent (the session) lives on.
        marker = os.path.join(self.tmp, "applied")
        command = " ".join([shutil.which("timeout"), "60", sys.executable, TOOL, "--state",
                            self.state, "add-native", "--source", os.path.join(self.proj, "k.c"),
                            "--patched", os.path.join(self.proj, "fast.c"), "--no-build"])
        agent = subprocess.Popen(["sh", "-c", 'sh -c "$0" && touch "$1"; exec sleep 60',
                                  command, marker], start_new_session=True)
        self.addCleanup(agent.wait)
        self.addCleanup(subprocess.run, ["kill", "-9", "--", "-%d" % agent.pid],
                        stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 60
        while not os.path.exists(marker) and time.monotonic() < deadline:
            time.sleep(0.05)
        owner = read_json(os.path.join(self.state, "journal.json"))["owner"]
        self.assertEqual(owner["pid"], agent.pid)
        rc, out, err = call("gc-stale", "--root", self.tmp)
        self.assertEqual((rc, err), (0, ""))
        self.assertIn("live: %s (owner pid %d" % (self.state, agent.pid), out)
        self.assertNotEqual(tree_state(self.proj), self.original)
        os.killpg(agent.pid, 9)
        agent.wait()
        self.assertOk(call("gc-stale", "--root", self.tmp))
        self.assertEqual(tree_state(self.proj), self.original)

    def apply_in_process_then_by_command(self, prefix: list = (), hide_session: bool = False,
                                         **popen) -> None:
        """An optimizer imports the tool for one step and runs it as a command
        for the next: both steps must be the same owner.  With `hide_session`
        getsid() answers 0 in both, as it does where the session leader lies
        outside the pid namespace (a container started from outside)."""
        hide = "import os\nos.getsid = lambda pid: 0\n" if hide_session else ""
        program = (hide + "import subprocess, sys\nsys.path.insert(0, sys.argv[1])\n"
                   "import overlay_setup\n"
                   "rc = overlay_setup.main(sys.argv[3:5] + ['add-python', 'm', sys.argv[5]])\n"
                   "command = [sys.executable, '-c', %r, sys.argv[2]] + sys.argv[3:5] + "
                   "['add-python', 'n', sys.argv[5]]\n"
                   "update = subprocess.run(command, stderr=subprocess.PIPE, "
                   "universal_newlines=True)\n"
                   "print(rc, update.returncode, update.stderr.strip())\n"
                   % (hide + "import runpy, sys\nsys.argv = sys.argv[1:]\n"
                      "runpy.run_path(sys.argv[0], run_name='__main__')\n"))
        module = os.path.join(self.tmp, "m.py")
        write_tree(self.tmp, {"m.py": "X = 1\n"})
        result = subprocess.run(list(prefix) + [sys.executable, "-c", program,
                                                os.path.dirname(TOOL), TOOL, "--state",
                                                self.state, module],
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                universal_newlines=True, timeout=120, **popen)
        self.assertEqual(result.stdout.splitlines()[-1:], ["0 0 "], result.stdout)
        self.assertOk(call("--state", self.state, "revert"))

    def test_a_program_leading_its_session_owns_what_it_applies_in_process_and_by_command(
            self) -> None:
        self.apply_in_process_then_by_command(start_new_session=True)

    def test_with_no_session_leader_in_sight_a_program_owns_what_it_applies_both_ways(
            self) -> None:
        self.apply_in_process_then_by_command(hide_session=True)

    def in_pid_namespace(self, pid_1_waits: bool) -> list:
        """The command line that runs what follows it in a new pid namespace,
        whose session began outside it (so getsid() answers 0); with
        `pid_1_waits` a shell is pid 1 there, else what follows is."""
        if shutil.which("unshare") is None:
            self.skipTest("unshare is not installed (util-linux)")
        unshare = ["unshare", "--pid", "--fork", "--mount-proc", "--"]
        if pid_1_waits:
            unshare += ["sh", "-c", '"$@"; :', "sh"]
        probe = subprocess.run(unshare + ["true"], stdout=subprocess.DEVNULL,
                               stderr=subprocess.DEVNULL)
        if probe.returncode != 0:
            self.skipTest("cannot make a pid namespace here (unshare --pid needs privileges)")
        return unshare

    def test_in_a_pid_namespace_a_program_owns_what_it_applies_both_ways(self) -> None:
        self.apply_in_process_then_by_command(self.in_pid_namespace(pid_1_waits=True))

    def add_in_pid_namespace(self, pid_1_waits: bool) -> subprocess.CompletedProcess:
        return subprocess.run(self.in_pid_namespace(pid_1_waits) + [
            sys.executable, TOOL, "--state", self.state, "add-native", "--source",
            os.path.join(self.proj, "k.c"), "--patched", os.path.join(self.proj, "fast.c"),
            "--no-build"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            universal_newlines=True)

    def test_pid_1_of_a_namespace_is_told_to_name_the_owner_and_changes_nothing(self) -> None:
        result = self.add_in_pid_namespace(pid_1_waits=False)
        self.assertEqual((result.returncode, result.stdout, result.stderr), (
            2, "", "overlay_setup: E108 no process can own this overlay: this one is pid 1 of its "
            "namespace and has no parent; pass --owner-pid with the pid of the process that "
            "uses the overlay\n"))
        self.assertFalse(os.path.exists(self.state))
        self.assertEqual(tree_state(self.proj), self.original)

    def test_an_overlay_applied_in_another_pid_namespace_is_never_called_gone(self) -> None:
        # A container sharing the host's name: its pids mean nothing here, so
        # neither gc-stale nor status may take its owner for gone.
        result = self.add_in_pid_namespace(pid_1_waits=True)
        self.assertEqual(result.returncode, 0, result.stderr)
        owner = read_json(os.path.join(self.state, "journal.json"))["owner"]
        self.assertNotEqual(owner["pid_ns"], os.readlink("/proc/self/ns/pid"))
        rc, out, err = call("gc-stale", "--root", self.tmp)
        self.assertEqual((rc, out, err), (0, "live: %s (owner pid %d on %s (in another pid "
                                             "namespace: cannot tell from here))\n"
                                          % (self.state, owner["pid"], owner["host"]), ""))
        self.assertNotEqual(tree_state(self.proj), self.original)
        rc, out, _ = call("--state", self.state, "status")
        self.assertIn("owner: pid %d on %s (in another pid namespace: cannot tell from here)\n"
                      % (owner["pid"], owner["host"]), out)
        self.assertOk(call("--state", self.state, "revert"))
        self.assertEqual(tree_state(self.proj), self.original)

    def test_killed_run_is_reverted_and_live_one_is_untouched(self) -> None:
        killed = forked_tool(["--state", self.state, "add-native", "--source",
                              os.path.join(self.proj, "k.c"), "--patched",
                              os.path.join(self.proj, "fast.c"), "--build-cmd", "kill -9 $PPID",
                              "--build-cwd", self.proj], own=True)
        self.assertEqual(killed.returncode, -9)
        live_state = os.path.join(self.tmp, "sub", ".overlay")
        live_proj = os.path.join(self.tmp, "live")
        write_tree(live_proj, {"k.c": "int k;\n"})
        self.assertOk(call("--state", live_state, "add-native", "--source",
                           os.path.join(live_proj, "k.c"), "--patched",
                           os.path.join(self.proj, "fast.c"), "--no-build",
                           "--owner-pid", str(os.getpid())))
        self.assertEqual(call("gc-stale", "--dry-run"), (
            0, "stale: %s (owner pid %d on %s (gone)): would revert\nlive: %s (owner pid %d on %s "
            "(live))\n" % (self.state, read_json(self.state + "/journal.json")["owner"]
                           ["pid"], overlay_setup.host_name(), live_state, os.getpid(),
                           overlay_setup.host_name()), ""))
        self.assertNotEqual(tree_state(self.proj), self.original)
        rc, out, err = call("gc-stale")
        self.assertEqual((rc, err), (0, ""))
        self.assertIn("stale: %s (owner pid" % self.state, out)
        self.assertIn("): reverted\n", out)
        self.assertEqual(tree_state(self.proj), self.original)
        self.assertIn("int k = 7;", read_text(os.path.join(live_proj, "k.c")))
        self.assertOk(call("--state", live_state, "revert"))

    def test_build_left_running_by_a_killed_run_is_stopped_before_the_revert(self) -> None:
        late = os.path.join(self.proj, "late.o")
        killed = forked_tool(["--state", self.state, "add-native", "--source",
                              os.path.join(self.proj, "k.c"), "--patched",
                              os.path.join(self.proj, "fast.c"), "--build-cmd",
                              "sleep 0.5; kill -9 $PPID; sleep 1; echo late > late.o",
                              "--build-cwd", self.proj],
                             own=True)
        self.assertEqual(killed.returncode, -9)
        rc, out, err = call("gc-stale")
        self.assertEqual(rc, 0, err)
        self.assertIn("): reverted\n", out)
        self.assertRegex(err, r"^stopping the build that entry 1 left running \(process group "
                              r"\d+\)\n$")
        self.assertEqual(wait_for_no_process_in(self.proj), [])
        self.assertFalse(os.path.exists(late))
        self.assertEqual(tree_state(self.proj), self.original)

    def test_status_tells_owner_tool_and_a_build_left_running_apart(self) -> None:
        killed = forked_tool(["--state", self.state, "add-native", "--source",
                              os.path.join(self.proj, "k.c"), "--patched",
                              os.path.join(self.proj, "fast.c"), "--build-cmd",
                              "sleep 0.3; kill -9 $PPID; exec sleep 30", "--build-cwd", self.proj],
                             own=True)
        self.assertEqual(killed.returncode, -9)
        build = read_json(os.path.join(self.state, "journal.json"))["entries"][0]["build"]
        pid = build["process"]["pid"]
        rc, out, err = call("--state", self.state, "status")
        self.assertEqual((rc, err), (0, ""))
        self.assertRegex(out, r"owner: pid \d+ on \S+ \(gone\)\ntool: none running\n")
        self.assertIn("entry 1: building: build pid %d, process group %d, running since %s; the "
                      "overlay_setup.py process that started it is gone\n"
                      % (pid, pid, build["process"]["since"]), out)
        self.assertNotIn("None", out)
        self.assertIn("next: `overlay_setup.py --state %s revert` (it stops a build left running "
                      "and restores everything)\n" % self.state, out)
        self.assertOk(call("--state", self.state, "revert"))
        self.assertFalse(overlay_setup.group_alive(pid))
        self.assertEqual(tree_state(self.proj), self.original)

    def test_a_closed_stdout_is_no_journal_error(self) -> None:
        self.assertEqual(self.apply(owner=os.getpid()).returncode, 0)
        reader, writer = os.pipe()
        os.close(reader)
        status = subprocess.run([sys.executable, TOOL, "--state", self.state, "status"],
                                stdout=writer, stderr=subprocess.PIPE, universal_newlines=True)
        os.close(writer)
        self.assertEqual((status.returncode, status.stderr), (141, ""))
        self.assertOk(call("--state", self.state, "revert"))

    def test_damaged_journal_fields_are_refused_and_nothing_changes(self) -> None:
        self.assertEqual(self.apply(owner=os.getpid()).returncode, 0)
        path = os.path.join(self.state, "journal.json")
        applied = tree_state(self.proj)
        damages = (("owner", lambda m: m.update(owner="x")),
                   ("python", lambda m: m.pop("python")),
                   ("next_id", lambda m: m.pop("next_id")),
                   ("entries[0].state", lambda m: m["entries"][0].pop("state")),
                   ("entries[0].id", lambda m: m["entries"][0].update(id="1")),
                   ("entries[0].sources[0].mode",
                    lambda m: m["entries"][0]["sources"][0].update(mode="644")))
        good = read_json(path)
        for field, damage in damages:
            with self.subTest(field=field):
                journal = json.loads(json.dumps(good))
                damage(journal)
                write_json(path, journal)
                for command in (["status"], ["revert"]):
                    rc, out, err = call("--state", self.state, *command)
                    self.assertEqual(rc, 1)
                    self.assertEqual(err, "overlay_setup: E202 journal %s has a missing or "
                                          "mistyped %s; it was edited or damaged, and nothing was "
                                          "changed: restore it, or move the state directory away "
                                          "if nothing is applied\n" % (path, field))
                self.assertEqual(tree_state(self.proj), applied)
        write_json(path, good)
        self.assertEqual(call("--state", self.state, "revert")[0], 0)
        self.assertEqual(tree_state(self.proj), self.original)

    def test_files_changed_after_a_run_killed_in_its_build_are_moved_aside(self) -> None:
        killed = forked_tool(["--state", self.state, "add-native", "--source",
                              os.path.join(self.proj, "k.c"), "--patched",
                              os.path.join(self.proj, "fast.c"), "--build-cmd",
                              "echo obj > made.o; kill -9 $PPID", "--build-cwd", self.proj], own=True)
        self.assertEqual(killed.returncode, -9)
        write_tree(self.proj, {"mywork.c": "work\n"})  # the caller's own, after the crash
        rc, out, err = call("gc-stale")
        self.assertEqual(rc, 0, err)
        aside = os.path.join(self.state, "leftovers", "1")
        self.assertEqual(err, "entry 1: the run stopped before it recorded what its build made; 2 "
                              "file(s) that appeared or changed in %s since the build began (its "
                              "products, or your own edits) are moved to %s: made.o, mywork.c\n"
                              % (self.proj, aside))
        self.assertEqual(tree_state(self.proj), self.original)
        self.assertEqual(read_text(os.path.join(aside, "mywork.c")), "work\n")
        self.assertEqual(read_text(os.path.join(aside, "made.o")), "obj\n")

    def test_a_state_directory_of_the_state_home_holding_leftovers_is_not_removed(self) -> None:
        # What a revert after a killed build moves aside may be the user's
        # own edits: the later gc-stale that removes reverted state
        # directories of the state home keeps this one and says why.
        state = os.path.join(overlay_setup.state_home(), "killed")
        killed = forked_tool(["--state", state, "add-native", "--source",
                              os.path.join(self.proj, "k.c"), "--patched",
                              os.path.join(self.proj, "fast.c"), "--build-cmd",
                              "echo work > mywork.c; kill -9 $PPID", "--build-cwd", self.proj],
                             own=True)
        self.assertEqual(killed.returncode, -9)
        self.assertEqual(call("gc-stale")[0], 0)
        aside = os.path.join(state, "leftovers", "1")
        self.assertEqual(call("gc-stale"), (
            0, "kept %s: its leftovers folder holds files moved aside when a killed build was "
               "reverted (a build's products, or your own edits); look at them, then remove the "
               "directory\n" % state, ""))
        self.assertEqual(read_text(os.path.join(aside, "mywork.c")), "work\n")
        self.assertEqual(tree_state(self.proj), self.original)

    def test_a_second_killed_build_does_not_overwrite_what_the_first_moved_aside(self) -> None:
        # next_id starts again at 1 once nothing is applied: both runs are entry 1.
        for work in ("first", "second"):
            killed = forked_tool(["--state", self.state, "add-native", "--source",
                                  os.path.join(self.proj, "k.c"), "--patched",
                                  os.path.join(self.proj, "fast.c"), "--build-cmd",
                                  "echo %s > mywork.c; kill -9 $PPID" % work,
                                  "--build-cwd", self.proj], own=True)
            self.assertEqual(killed.returncode, -9)
            rc, out, err = call("gc-stale")
            self.assertEqual(rc, 0, err)
        aside = os.path.join(self.state, "leftovers", "1-2")
        self.assertIn("are moved to %s: mywork.c\n" % aside, err)
        self.assertEqual(read_text(os.path.join(self.state, "leftovers", "1", "mywork.c")),
                         "first\n")
        self.assertEqual(read_text(os.path.join(aside, "mywork.c")), "second\n")
        self.assertEqual(tree_state(self.proj), self.original)

    def test_directory_that_is_no_state_directory_is_refused(self) -> None:
        mine = os.path.join(self.tmp, "mine")
        write_tree(mine, {"python/notes.txt": "keep\n", "site/sitecustomize.py": "X = 1\n"})
        before = tree_state(mine)
        rc, out, err = call("--state", mine, "add-native", "--source",
                            os.path.join(self.proj, "k.c"), "--patched",
                            os.path.join(self.proj, "fast.c"), "--no-build",
                            "--owner-pid", str(os.getpid()))
        self.assertEqual(rc, 1)
        self.assertEqual(err, "overlay_setup: E206 state directory %s already holds python, site "
                              "and no journal; it is not an overlay state directory: pass a new "
                              "or empty --state\n" % mine)
        self.assertEqual(tree_state(mine), before)
        self.assertEqual(tree_state(self.proj), self.original)

    def test_missing_journal_beside_backups_is_not_nothing_to_revert(self) -> None:
        self.assertEqual(self.apply(owner=os.getpid()).returncode, 0)
        applied = tree_state(self.proj)
        os.remove(os.path.join(self.state, "journal.json"))
        for command in ("revert", "status"):
            rc, out, err = call("--state", self.state, command)
            self.assertEqual(rc, 1)
            self.assertEqual(err, "overlay_setup: E202 journal %s is missing, but %s holds the "
                                  "backups of entries that may still be applied; restore the "
                                  "journal, or put the files back from there by hand\n"
                                  % (os.path.join(self.state, "journal.json"),
                                     os.path.join(self.state, "backups")))
        self.assertEqual(tree_state(self.proj), applied)

    def test_file_names_that_are_not_utf8_are_printed_escaped(self) -> None:
        source = os.path.join(os.fsencode(self.proj), b"k\xff.c")
        with open(source, "wb") as handle:
            handle.write(b"int k;\n")
        env = dict(os.environ, PYTHONIOENCODING="utf-8")
        for args in (["add-native", "--source", os.fsdecode(source), "--patched",
                      os.path.join(self.proj, "fast.c"), "--no-build"], ["revert"]):
            done = subprocess.run([sys.executable, TOOL, "--state", self.state] + args
                                  + (["--owner-pid", str(os.getpid())] if args[0] != "revert"
                                     else []), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                  env=env)
            self.assertEqual((done.returncode, done.stderr), (0, b""), args)
            self.assertIn(b"k\\udcff.c", done.stdout)
        with open(source, "rb") as handle:
            self.assertEqual(handle.read(), b"int k;\n")

    def test_a_state_whose_journal_version_1_0_named_manifest_json_reverts_and_is_gc_staled(
            self) -> None:
        # Version 1.0 named the journal manifest.json; the format is unchanged.
        journal, old = (os.path.join(self.state, name) for name in ("journal.json",
                                                                    "manifest.json"))
        for command in (["--state", self.state, "revert"], ["gc-stale", "--root", self.tmp]):
            self.assertEqual(self.apply(owner=os.getpid()).returncode, 0)
            written = read_json(journal)
            written["owner"]["start_time"] = "1"  # gone: gc-stale reverts it
            write_json(old, written)
            os.unlink(journal)
            rc, out, err = call("--state", self.state, "status")
            self.assertEqual((rc, err), (0, ""))
            self.assertIn("entry 1: applied, without a build\n", out)
            rc, out, err = call(*command)
            self.assertEqual((rc, err), (0, ""))
            self.assertIn("reverted", out)
            self.assertEqual(tree_state(self.proj), self.original)
            self.assertEqual(sorted(name for name in os.listdir(self.state)
                                    if name.endswith(".json")), ["journal.json"])

    def test_a_version_1_0_journal_left_beside_the_new_one_goes_at_the_next_write(
            self) -> None:
        # A run killed between writing journal.json and removing manifest.json
        # leaves both; the old one would be read by version 1.0 and names
        # entries and backups that are no longer so.
        journal, old = (os.path.join(self.state, name) for name in ("journal.json",
                                                                    "manifest.json"))
        self.assertEqual(self.apply(owner=os.getpid()).returncode, 0)
        write_json(old, read_json(journal))
        rc, out, err = call("--state", self.state, "revert")
        self.assertEqual((rc, err), (0, ""))
        self.assertIn("reverted", out)
        self.assertEqual(tree_state(self.proj), self.original)
        self.assertEqual(sorted(name for name in os.listdir(self.state)
                                if name.endswith(".json")), ["journal.json"])

    def test_a_folder_named_manifest_json_in_the_state_is_no_journal_and_stays(self) -> None:
        self.assertEqual(self.apply(owner=os.getpid()).returncode, 0)
        os.mkdir(os.path.join(self.state, "manifest.json"))
        rc, out, err = call("--state", self.state, "revert")
        self.assertEqual((rc, err), (0, ""))
        self.assertEqual(tree_state(self.proj), self.original)
        self.assertTrue(os.path.isdir(os.path.join(self.state, "manifest.json")))

    def test_with_nothing_stale_it_says_so_and_where_it_looked(self) -> None:
        self.assertEqual(call("gc-stale", "--root", self.proj), (
            0, "nothing stale: no state directory under %s or in the registry\n" % self.proj, ""))
        self.assertEqual(self.apply(owner=os.getpid()).returncode, 0)
        self.assertOk(call("--state", self.state, "revert"))
        self.assertEqual(call("gc-stale", "--root", self.tmp, "--dry-run"), (
            0, "nothing stale: 1 state directory with nothing applied under %s or in the "
               "registry\n" % self.tmp, ""))

    def test_reused_pid_with_another_start_time_counts_as_gone(self) -> None:
        self.assertEqual(self.apply(owner=os.getpid()).returncode, 0)
        path = os.path.join(self.state, "journal.json")
        journal = read_json(path)
        journal["owner"]["start_time"] = "1"
        write_json(path, journal)
        rc, out, _ = call("gc-stale", "--root", self.tmp)
        self.assertEqual(rc, 0)
        self.assertIn("): reverted", out)
        self.assertEqual(tree_state(self.proj), self.original)

    def test_locked_state_is_live(self) -> None:
        self.assertEqual(self.apply().returncode, 0)
        state = overlay_setup.State(self.state)
        self.assertTrue(state.try_lock("holder"))
        try:
            rc, out, _ = call("gc-stale", "--root", self.tmp)
        finally:
            state.unlock()
        self.assertEqual(rc, 0)
        self.assertRegex(out, r"^live: %s \(locked by pid %d on .*\)\n$" % (self.state, os.getpid()))
        self.assertNotEqual(tree_state(self.proj), self.original)

    def test_group_writable_state_is_refused_and_reported(self) -> None:
        self.assertEqual(self.apply().returncode, 0)
        os.chmod(self.state, 0o770)
        self.assertEqual(call("gc-stale", "--root", self.tmp), (
            1, "", "overlay_setup: E204 state directory %s is writable by group or others (mode "
            "770); refusing to use it: run `chmod go-w %s` if you trust its contents\n"
            "overlay_setup: 1 state directory refused or failed; see above\n"
            % (self.state, self.state)))
        self.assertNotEqual(tree_state(self.proj), self.original)
        self.assertEqual(self.tool("revert"), (
            1, "", "overlay_setup: E204 state directory %s is writable by group or others (mode "
            "770); refusing to use it: run `chmod go-w %s` if you trust its contents\n"
            % (self.state, self.state)))

    @unittest.skipUnless(os.geteuid() == 0, "changing a directory's owner needs root")
    def test_state_owned_by_another_user_is_refused_and_reported(self) -> None:
        self.assertEqual(self.apply().returncode, 0)
        os.chown(self.state, 4242, 4242)
        self.assertEqual(call("gc-stale", "--root", self.tmp), (
            1, "", "overlay_setup: E204 state directory %s is owned by uid 4242, not by you (uid "
            "0); refusing to use it\noverlay_setup: 1 state directory refused or failed; see "
            "above\n" % self.state))
        self.assertNotEqual(tree_state(self.proj), self.original)

class OtherHostTest(OverlayTestCase):
    """A state directory on a file system shared by several hosts: an owner
    on another host cannot be checked from here, so its finished overlay is
    live; an entry a run on any host left halfway is stale all the same."""

    HOST = "build-node-7.example"

    def setUp(self) -> None:
        super().setUp()
        self.proj = os.path.join(self.tmp, "proj")
        write_tree(self.proj, {"k.c": "int k;\n", "fast.c": "int k = 7;\n"})
        self.original = tree_state(self.proj)
        self.assertOk(self.tool("add-native", "--source", os.path.join(self.proj, "k.c"),
                                "--patched", os.path.join(self.proj, "fast.c"), "--no-build",
                                "--owner-pid", "1"))
        self.applied = tree_state(self.proj)
        self.journal = os.path.join(self.state, "journal.json")
        journal = read_json(self.journal)
        journal["owner"]["host"] = self.HOST
        write_json(self.journal, journal)

    def owner(self) -> str:
        return "owner pid 1 on %s (other-host)" % self.HOST

    def test_a_finished_overlay_owned_on_another_host_is_live(self) -> None:
        for dry_run in ([], ["--dry-run"]):
            with self.subTest(dry_run=dry_run):
                self.assertEqual(call("gc-stale", "--root", self.tmp, *dry_run),
                                 (0, "live: %s (%s)\n" % (self.state, self.owner()), ""))
                self.assertEqual(tree_state(self.proj), self.applied)

    def test_an_entry_a_run_on_another_host_left_halfway_is_stale(self) -> None:
        journal = read_json(self.journal)
        journal["entries"][0]["state"] = overlay_setup.NativeEntry.APPLYING
        write_json(self.journal, journal)
        why = "%s; the run applying entry 1 stopped halfway" % self.owner()
        self.assertEqual(call("gc-stale", "--root", self.tmp, "--dry-run"),
                         (0, "stale: %s (%s): would revert\n" % (self.state, why), ""))
        self.assertEqual(tree_state(self.proj), self.applied)
        self.assertEqual(call("gc-stale", "--root", self.tmp),
                         (0, "stale: %s (%s): reverted\n" % (self.state, why), ""))
        self.assertEqual(tree_state(self.proj), self.original)


@unittest.skipUnless(shm_available(), "needs /dev/shm on another filesystem than the temp dir")
class TarSnapshotTest(OverlayTestCase):
    """A cache on another filesystem is snapshotted with tar and restored safely."""

    def setUp(self) -> None:
        super().setUp()
        self.proj = os.path.join(self.tmp, "proj")
        write_tree(self.proj, {"k.c": "int k;\n", "fast.c": "int k = 7;\n"})
        self.cache = tempfile.mkdtemp(prefix="overlay-cache-", dir="/dev/shm")
        self.addCleanup(shutil.rmtree, self.cache, True)
        write_tree(self.cache, {"obj/k.o": "object\n", "index": "1\n"})
        os.symlink("obj/k.o", os.path.join(self.cache, "latest"))
        os.chmod(os.path.join(self.cache, "index"), 0o640)
        self.before = tree_state(self.cache)
        self.assertOk(self.tool("add-native", "--source", os.path.join(self.proj, "k.c"),
                                "--patched", os.path.join(self.proj, "fast.c"),
                                "--invalidate-cache", self.cache, "--no-build"))
        self.assertFalse(os.path.exists(self.cache))
        journal = read_json(os.path.join(self.state, "journal.json"))
        self.archive = os.path.join(self.state, journal["entries"][0]["caches"][0]["backup"])
        self.assertTrue(self.archive.endswith(".tar"))

    def plant(self, *members) -> None:
        with tarfile.open(self.archive, "w") as tar:
            for name, kind, link in members:
                info = tarfile.TarInfo(name)
                info.type = kind
                info.linkname = link
                if kind == tarfile.REGTYPE:
                    info.size = 2
                    tar.addfile(info, io.BytesIO(b"x\n"))
                else:
                    tar.addfile(info)

    def refused(self, name: str, why: str) -> None:
        rc, out, err = self.tool("revert")
        self.assertEqual((rc, out), (1, ""))
        self.assertEqual(err, "overlay_setup: E502 snapshot %s holds member %r, %s; nothing was "
                              "restored from it: the snapshot was tampered with, rebuild the cache "
                              "instead\n" % (self.archive, name, why))
        self.assertFalse(os.path.exists(self.cache))
        self.assertIn("int k = 7;", read_text(os.path.join(self.proj, "k.c")))
        self.assertFalse(os.path.exists(os.path.join(self.tmp, "escaped")))

    def test_cache_on_another_filesystem_round_trips_through_tar(self) -> None:
        self.assertOk(self.tool("revert"))
        self.assertEqual(tree_state(self.cache), self.before)

    def test_cache_holding_a_fifo_is_refused_before_anything_changes(self) -> None:
        self.assertOk(self.tool("revert"))
        os.mkfifo(os.path.join(self.cache, "pipe"))
        before = (tree_state(self.proj), tree_state(self.cache))
        rc, out, err = self.tool("add-native", "--source", os.path.join(self.proj, "k.c"),
                                 "--patched", os.path.join(self.proj, "fast.c"),
                                 "--invalidate-cache", self.cache, "--no-build")
        self.assertEqual(rc, 1)
        self.assertEqual(err, "overlay_setup: E106 cache %s holds %s, which is neither a file, a "
                              "directory nor a symlink; clear it before the overlay\n"
                              % (self.cache, os.path.join(self.cache, "pipe")))
        self.assertEqual((tree_state(self.proj), tree_state(self.cache)), before)
        self.assertOk(self.tool("revert"))

    def test_snapshot_that_is_no_archive_is_refused(self) -> None:
        for content in (b"", b"garbage" * 100):
            with self.subTest(content=content[:7]):
                with open(self.archive, "wb") as handle:
                    handle.write(content)
                rc, out, err = self.tool("revert")
                self.assertEqual(rc, 1)
                self.assertRegex(err, r"^overlay_setup: E502 snapshot %s cannot be read \(.*\); "
                                      r"nothing was restored from it: rebuild the cache instead\n$"
                                 % re.escape(self.archive))
                self.assertIn("int k = 7;", read_text(os.path.join(self.proj, "k.c")))

    def test_member_with_an_mtime_that_is_no_number_is_refused(self) -> None:
        with tarfile.open(self.archive, "w", format=tarfile.PAX_FORMAT) as tar:
            info = tarfile.TarInfo("index")
            info.pax_headers = {overlay_setup.MTIME_KEY: "soon"}
            tar.addfile(info)
        self.refused("index", "an mtime that is no number")

    @unittest.skipUnless(os.geteuid() == 0, "only root can give files to another owner")
    def test_owners_come_back_from_the_snapshot(self) -> None:
        self.assertOk(self.tool("revert"))
        for relative in ("", "obj", "obj/k.o", "index", "latest"):
            os.chown(os.path.join(self.cache, relative), 65534, 65533, follow_symlinks=False)
        owners = {p: (st.st_uid, st.st_gid) for p, st in
                  ((p, os.lstat(os.path.join(self.cache, p))) for p in ("", "obj", "obj/k.o",
                                                                        "index", "latest"))}
        before = tree_state(self.cache)
        self.assertOk(self.tool("add-native", "--source", os.path.join(self.proj, "k.c"),
                                "--patched", os.path.join(self.proj, "fast.c"),
                                "--invalidate-cache", self.cache, "--no-build"))
        self.assertOk(self.tool("revert"))
        self.assertEqual({p: (st.st_uid, st.st_gid) for p, st in
                          ((p, os.lstat(os.path.join(self.cache, p))) for p in owners)}, owners)
        self.assertEqual(tree_state(self.cache), before)

    def test_member_with_dotdot_is_refused(self) -> None:
        self.plant((".", tarfile.DIRTYPE, ""), ("../escaped", tarfile.REGTYPE, ""))
        self.refused("../escaped", "a path with '..'")

    def test_absolute_member_is_refused(self) -> None:
        self.plant(("/tmp/escaped", tarfile.REGTYPE, ""))
        self.refused("/tmp/escaped", "an absolute path")

    def test_device_member_is_refused(self) -> None:
        self.plant(("null", tarfile.CHRTYPE, ""))
        self.refused("null", "a device, fifo or other special file")

    def test_symlinks_pointing_out_of_the_cache_come_back_as_they_were(self) -> None:
        self.assertOk(self.tool("revert"))
        os.symlink("/usr/bin/python3", os.path.join(self.cache, "python"))
        os.symlink("../x", os.path.join(self.cache, "obj", "up"))
        os.symlink("../../escaped", os.path.join(self.cache, "out"))
        os.setxattr(os.path.join(self.cache, "index"), "user.origin", b"cmake")
        before = tree_state(self.cache)
        self.assertOk(self.tool("add-native", "--source", os.path.join(self.proj, "k.c"),
                                "--patched", os.path.join(self.proj, "fast.c"),
                                "--invalidate-cache", self.cache, "--no-build"))
        self.assertFalse(os.path.exists(self.cache))
        self.assertOk(self.tool("revert"))
        self.assertEqual(tree_state(self.cache), before)
        self.assertEqual(os.getxattr(os.path.join(self.cache, "index"), "user.origin"), b"cmake")
        self.assertEqual(read_text(os.path.join(self.proj, "k.c")), "int k;\n")

    def test_a_hard_link_through_a_chain_of_symlink_members_is_refused(self) -> None:
        handle, victim = tempfile.mkstemp(dir="/dev/shm")
        os.close(handle)
        self.addCleanup(os.unlink, victim)
        linkname = "sub/esc/" + os.path.basename(victim)
        self.plant((".", tarfile.DIRTYPE, ""), ("sub", tarfile.DIRTYPE, ""),
                   ("sub/up", tarfile.SYMTYPE, ".."), ("sub/esc", tarfile.SYMTYPE, "up/.."),
                   ("h", tarfile.LNKTYPE, linkname))
        self.refused("h", "a hard link to %r, which is no earlier file of the snapshot" % linkname)
        self.assertEqual(os.stat(victim).st_nlink, 1)

    def test_a_planted_symlink_is_restored_as_a_link_and_nothing_is_written_through_it(self) -> None:
        self.plant((".", tarfile.DIRTYPE, ""), ("out", tarfile.SYMTYPE, "../../escaped"),
                   ("later", tarfile.REGTYPE, ""))
        self.assertOk(self.tool("revert"))
        self.assertEqual(os.readlink(os.path.join(self.cache, "out")), "../../escaped")
        self.assertEqual(read_text(os.path.join(self.cache, "later")), "x\n")
        self.assertFalse(os.path.exists(os.path.join(self.tmp, "escaped")))

    def test_write_through_a_symlink_member_is_refused(self) -> None:
        self.plant(("sub", tarfile.SYMTYPE, "."), ("sub/file", tarfile.REGTYPE, ""))
        self.refused("sub/file", "a path through a symlink")


@unittest.skipUnless(shm_available(), "needs /dev/shm on another filesystem than the temp dir")
class SnapshotHardLinkTest(OverlayTestCase):
    """Hard links of a cache that is snapshotted with tar (on /dev/shm, another
    filesystem than the state directory): within the cache they come back as
    links; one with a name outside the cache is refused up front."""

    def setUp(self) -> None:
        super().setUp()
        self.proj = os.path.join(self.tmp, "proj")
        write_tree(self.proj, {"k.c": "int k;\n", "fast.c": "int k = 7;\n"})
        self.shm = tempfile.mkdtemp(prefix="overlay-links-", dir="/dev/shm")
        self.addCleanup(shutil.rmtree, self.shm, True)
        self.cache = os.path.join(self.shm, "cache")
        write_tree(self.cache, {"a.o": "A\n", "sub/keep": "K\n", "one": "1\n"})

    def add(self) -> tuple:
        return self.tool("add-native", "--source", os.path.join(self.proj, "k.c"), "--patched",
                         os.path.join(self.proj, "fast.c"), "--invalidate-cache", self.cache,
                         "--no-build", "--owner-pid", str(os.getpid()))

    def links(self) -> dict:
        """name -> (the first name of its inode, link count), for every file of the cache."""
        first, found = {}, {}
        for relative in sorted(tree_state(self.cache)):
            st = os.lstat(os.path.join(self.cache, relative))
            if stat.S_ISREG(st.st_mode):
                found[relative] = (first.setdefault(st.st_ino, relative), st.st_nlink)
        return found

    def test_hard_links_within_the_cache_come_back_as_links(self) -> None:
        os.link(os.path.join(self.cache, "a.o"), os.path.join(self.cache, "sub", "a-copy.o"))
        os.link(os.path.join(self.cache, "a.o"), os.path.join(self.cache, "z.o"))
        before, links = tree_state(self.cache), self.links()
        self.assertEqual(links, {"a.o": ("a.o", 3), "one": ("one", 1), "sub/a-copy.o": (
            "a.o", 3), "sub/keep": ("sub/keep", 1), "z.o": ("a.o", 3)})
        self.assertOk(self.add())
        self.assertFalse(os.path.exists(self.cache))
        self.assertOk(self.tool("revert"))
        self.assertEqual((tree_state(self.cache), self.links()), (before, links))

    def test_a_file_linked_from_outside_the_cache_is_refused_before_anything_changes(self) -> None:
        inside = os.path.join(self.cache, "a.o")
        outside = os.path.join(self.shm, "build-a.o")  # as ccache's hard_link mode makes them
        os.link(inside, outside)
        before = (tree_state(self.proj), tree_state(self.shm), os.stat(inside).st_ino)
        self.assertEqual(self.add(), (
            1, "", "overlay_setup: E122 --invalidate-cache %s holds %s, which has 2 hard links, "
            "1 of them outside the cache: restored from a snapshot it would come back as a "
            "separate file; nothing was changed: pass a --state on the cache's mount (the cache "
            "is then renamed aside whole), or give the file a copy of its own\n"
            % (self.cache, inside)))
        self.assertEqual((tree_state(self.proj), tree_state(self.shm), os.stat(inside).st_ino),
                         before)
        self.assertEqual(os.stat(outside).st_nlink, 2)


class StateDirectorySafetyTest(OverlayTestCase):
    """The state directory: nothing written into another program's directory,
    private to its owner, safe on concurrent first use, no backup left over."""

    def setUp(self) -> None:
        super().setUp()
        self.proj = os.path.join(self.tmp, "proj")
        write_tree(self.proj, {"k.c": "int k;\n", "fast.c": "int k = 7;\n"})
        self.original = tree_state(self.proj)

    def add(self, *extra: str) -> list:
        return ["--state", self.state, "add-native", "--source", os.path.join(self.proj, "k.c"),
                "--patched", os.path.join(self.proj, "fast.c"), "--no-build"] + list(extra)

    def test_no_state_home_is_made_in_another_users_home(self) -> None:
        # root with the user's HOME (sudo -E): a state home of root's there
        # would refuse the user ever after (E204/E210).
        if os.geteuid() != 0:
            self.skipTest("making a directory another user owns needs root")
        home = os.path.join(self.tmp, "home")
        os.makedirs(os.path.join(home, ".local"))
        for path in (home, os.path.join(home, ".local")):
            os.chown(path, 65534, 65534)
        os.environ["XDG_STATE_HOME"] = os.path.join(home, ".local", "state")
        before = tree_state(home)
        args = self.add()[2:]  # the default state directory
        self.assertEqual(call(*args), (
            1, "", "overlay_setup: E212 the state home %s would be made in %s, which uid 65534 "
            "owns, not you (uid 0), and that user could no longer use it (sudo -E keeps the "
            "user's HOME); nothing was changed: pass --state DIR, or set XDG_STATE_HOME to a "
            "directory of yours\n" % (os.path.join(home, ".local", "state", "overlay_setup"),
                                      os.path.join(home, ".local"))))
        self.assertEqual(call("gc-stale", "--root", self.proj)[0], 0)
        self.assertEqual((tree_state(home), tree_state(self.proj)), (before, self.original))

    def test_a_source_that_cannot_be_read_is_named_as_not_read(self) -> None:
        # Only root reads a file of mode 0200: the tool runs as user nobody.
        python = nobody_python(self)
        os.chmod(self.tmp, 0o755)
        source = os.path.join(self.proj, "k.c")
        os.chmod(source, 0o200)
        os.makedirs(os.path.join(self.tmp, "home"))
        for path in [self.proj, os.path.join(self.tmp, "home")] + [
                os.path.join(self.proj, name) for name in os.listdir(self.proj)]:
            os.chown(path, 65534, 65534)
        before = tree_state(self.proj)
        done = subprocess.run(["runuser", "-u", "nobody", "--", "env",
                               "XDG_STATE_HOME=" + self.tmp + "/home", python, TOOL,
                               "--state", os.path.join(self.tmp, "home", "state")] + self.add()[2:],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              universal_newlines=True, cwd=self.tmp)
        self.assertEqual((done.returncode, done.stderr), (
            1, "overlay_setup: E601 could not read %s (Permission denied); nothing stays "
            "applied: fix the cause and run the command again\n" % source))
        self.assertEqual(tree_state(self.proj), before)

    def test_gc_stale_never_writes_the_lock_of_another_programs_directory(self) -> None:
        other = os.path.join(self.tmp, "app")
        write_tree(other, {"manifest.json": '{"name": "app"}\n', "lock": "held by app\n"})
        before = tree_state(other)
        for dry_run in (["--dry-run"], []):
            rc, out, err = call("gc-stale", "--root", self.tmp, *dry_run)
            self.assertEqual((rc, out), (1, ""))
            self.assertEqual(err, "overlay_setup: E202 journal %s is not an overlay_setup journal; "
                                  "pass another --state\noverlay_setup: 1 state directory refused "
                                  "or failed; see above\n" % os.path.join(other, "manifest.json"))
            self.assertEqual(tree_state(other), before)
        rc, out, err = call("--state", other, "revert")
        self.assertEqual((rc, tree_state(other)), (1, before))

    def test_a_lone_lock_of_another_program_is_not_written(self) -> None:
        os.makedirs(self.state, 0o700)
        write_text_file(os.path.join(self.state, "lock"), "12345\n")
        rc, out, err = self.tool("init", "--owner-pid", str(os.getpid()))
        self.assertEqual(err, "overlay_setup: E206 state directory %s already holds lock and no "
                              "journal; it is not an overlay state directory: pass a new or empty "
                              "--state\n" % self.state)
        self.assertEqual(read_text(os.path.join(self.state, "lock")), "12345\n")

    def test_state_directory_is_private_and_one_others_can_enter_is_refused(self) -> None:
        self.assertOk(call(*self.add("--owner-pid", str(os.getpid()))))
        self.assertEqual(stat.S_IMODE(os.stat(self.state).st_mode), 0o700)
        os.chmod(self.state, 0o701)
        self.assertEqual(self.tool("revert"), (
            1, "", "overlay_setup: E204 state directory %s can be entered by others (mode 701); "
            "refusing to keep backups there: run `chmod o-rwx %s`\n" % (self.state, self.state)))
        self.assertNotEqual(tree_state(self.proj), self.original)
        os.chmod(self.state, 0o700)
        self.assertOk(self.tool("revert"))
        self.assertEqual(tree_state(self.proj), self.original)

    def test_concurrent_first_use_of_a_new_state_directory_succeeds(self) -> None:
        failures = []
        for round_number in range(4):
            state = os.path.join(self.tmp, "new%d" % round_number, "state")
            runs = forked_tools([["--state", state, "init", "--owner-pid", str(os.getpid())]] * 10)
            failures += [run.stderr for run in runs if run.returncode != 0]
            self.assertEqual(read_json(os.path.join(state, "journal.json"))["tool"],
                             "overlay_setup")
        self.assertEqual(failures, [])

    def test_backups_left_by_a_revert_killed_after_its_journal_write_are_removed(self) -> None:
        backups = os.path.join(self.state, "backups")
        for point in range(1, 30):
            shutil.rmtree(self.state, True)
            write_tree(self.proj, {"k.c": "int k;\n"})
            self.assertEqual(forked_tool(self.add("--owner-pid", str(os.getpid()))).returncode, 0)
            killed = forked_tool(["--state", self.state, "revert"],
                                 {"OVERLAY_TEST_KILL_AT": str(point)})
            self.assertEqual(killed.returncode, -9, "revert completed before the moment")
            if (not read_json(os.path.join(self.state, "journal.json"))["entries"]
                    and os.path.isdir(os.path.join(backups, "1"))):
                break
        self.assertEqual(self.tool("revert"), (
            0, "removed the backups of entry 1, left by a revert that was interrupted after it "
               "had restored them\nnothing to revert at %s\n" % self.state, ""))
        self.assertFalse(os.path.exists(backups))
        self.assertEqual(read_text(os.path.join(self.proj, "k.c")), "int k;\n")


def acl_granting(uid: int) -> bytes:
    """A POSIX access ACL as the kernel stores it: owner rw, user `uid` rw,
    group r, mask rw, others r."""
    import struct
    entries = ((0x01, 6, 0xffffffff), (0x02, 6, uid), (0x04, 4, 0xffffffff),
               (0x10, 6, 0xffffffff), (0x20, 4, 0xffffffff))
    return struct.pack("<I", 2) + b"".join(struct.pack("<HHI", *entry) for entry in entries)


class InstallFileSafetyTest(OverlayTestCase):
    """What revert writes into the install: never through a symlink, never a
    file left behind for good, every piece of metadata back."""

    def setUp(self) -> None:
        super().setUp()
        self.proj = os.path.join(self.tmp, "proj")
        write_tree(self.proj, {"build/k.c": "int k;\n", "fast.c": "int k = 7;\n",
                               "tool": "#!/bin/sh\n", "cache/entry": "cached\n"})
        self.source = os.path.join(self.proj, "build/k.c")

    def add(self, *extra: str, source: str = None) -> tuple:
        return self.tool("add-native", "--source", source or self.source, "--patched",
                         os.path.join(self.proj, "fast.c"), *extra)

    def test_a_directory_replaced_by_a_symlink_after_apply_is_not_written_through(self) -> None:
        victim = os.path.join(self.tmp, "victim")
        write_tree(victim, {"k.c": "victim's own\n", "new.c": "victim's new\n"})
        patch = os.path.join(self.tmp, "p.diff")
        write_text_file(patch, "--- a/build/k.c\n+++ b/build/k.c\n@@ -1 +1 @@\n-int k;\n"
                               "+int k = 7;\n--- /dev/null\n+++ b/build/new.c\n@@ -0,0 +1 @@\n"
                               "+int n;\n")
        self.assertOk(self.tool("apply", patch, "--root", self.proj, "--no-build"))
        os.rename(os.path.join(self.proj, "build"), os.path.join(self.proj, "build.moved"))
        os.symlink(victim, os.path.join(self.proj, "build"))
        before = tree_state(victim)
        for force in ([], ["--force"]):
            self.assertEqual(self.tool("revert", *force), (
                1, "", "overlay_setup: E505 %s is no longer what the journal recorded: %s is now "
                "a symlink; nothing was written through it: put the directory back (or move it "
                "away), then run revert again\n" % (self.source, os.path.join(self.proj, "build"))))
            self.assertEqual(tree_state(victim), before)
        os.unlink(os.path.join(self.proj, "build"))
        os.rename(os.path.join(self.proj, "build.moved"), os.path.join(self.proj, "build"))
        self.assertOk(self.tool("revert"))
        self.assertEqual(read_text(self.source), "int k;\n")
        self.assertFalse(os.path.exists(os.path.join(self.proj, "build/new.c")))

    def test_a_product_directory_replaced_by_a_symlink_is_not_deleted_through(self) -> None:
        victim = os.path.join(self.tmp, "victim")
        write_tree(victim, {"new.o": "victim's own\n"})
        write_tree(self.proj, {"out/keep": "kept\n"})
        self.assertOk(self.add("--build-cmd", "echo x > out/new.o", "--build-cwd", self.proj))
        os.rename(os.path.join(self.proj, "out"), os.path.join(self.proj, "out.moved"))
        os.symlink(victim, os.path.join(self.proj, "out"))
        self.assertEqual(self.tool("revert"), (
            1, "", "overlay_setup: E505 %s is no longer what the journal recorded: %s is now a "
            "symlink; nothing was written through it: put the directory back (or move it away), "
            "then run revert again\n" % (os.path.join(self.proj, "out", "new.o"),
                                         os.path.join(self.proj, "out"))))
        self.assertEqual(read_text(os.path.join(victim, "new.o")), "victim's own\n")

    def test_a_directory_that_held_an_untracked_product_gets_its_mtime_back(self) -> None:
        write_tree(self.proj, {"out/keep": "kept\n"})
        past = time.time() - 3600
        os.utime(os.path.join(self.proj, "out"), (past, past))
        before = tree_state(self.proj)
        self.assertOk(self.add("--build-cmd", "echo x > out/new.o", "--build-cwd", self.proj))
        self.assertOk(self.tool("revert"))
        self.assertEqual(tree_state(self.proj), before)

    def test_a_path_under_a_symlink_is_refused_at_apply(self) -> None:
        os.symlink(os.path.join(self.proj, "build"), os.path.join(self.tmp, "via"))
        rc, out, err = self.add("--no-build", source=os.path.join(self.tmp, "via", "k.c"))
        self.assertEqual((rc, out), (1, ""))
        self.assertEqual(err, "overlay_setup: E104 %s lies under %s, which is a symlink; pass the "
                              "real path %s\n" % (os.path.join(self.tmp, "via", "k.c"),
                                                  os.path.join(self.tmp, "via"), self.source))

    @unittest.skipUnless(os.geteuid() == 0, "giving a file to another owner needs root")
    def test_setuid_artifact_keeps_its_bits_and_its_backup_carries_none(self) -> None:
        tool = os.path.join(self.proj, "tool")
        os.chown(tool, 65534, 65534)
        os.chmod(tool, 0o6755)
        before = tree_state(self.proj)
        self.assertOk(self.add("--artifact", tool, "--build-cmd", "rm tool && cp fast.c tool",
                               "--build-cwd", self.proj))
        journal = read_json(os.path.join(self.state, "journal.json"))
        backup = os.path.join(self.state, journal["entries"][0]["artifacts"][0]["backup"])
        self.assertEqual(stat.S_IMODE(os.stat(backup).st_mode), 0o754)
        self.assertOk(self.tool("revert"))
        st = os.stat(tool)
        self.assertEqual((stat.S_IMODE(st.st_mode), st.st_uid, st.st_gid), (0o6755, 65534, 65534))
        self.assertEqual(tree_state(self.proj), before)

    def test_a_backup_that_is_no_regular_file_is_refused_as_altered_state(self) -> None:
        other = os.path.join(self.tmp, "other")
        write_text_file(other, "someone's\n")
        os.chmod(other, 0o600)
        self.assertOk(self.add("--artifact", os.path.join(self.proj, "tool"), "--no-build"))
        journal = read_json(os.path.join(self.state, "journal.json"))
        backup = os.path.join(self.state, journal["entries"][0]["artifacts"][0]["backup"])
        os.unlink(backup)
        os.symlink(other, backup)
        applied = tree_state(self.proj)
        self.assertEqual(self.tool("revert"), (
            1, "", "overlay_setup: E203 the backup of %s, %s, is not a regular file (a symlink, "
            "directory or special file); the state directory was altered, nothing was changed\n"
            % (os.path.join(self.proj, "tool"), backup)))
        self.assertEqual(stat.S_IMODE(os.stat(other).st_mode), 0o600)
        self.assertEqual(tree_state(self.proj), applied)

    def test_a_cache_backup_replaced_by_a_symlink_is_refused_as_altered_state(self) -> None:
        cache = os.path.join(self.proj, "cache")
        elsewhere = os.path.join(self.tmp, "elsewhere")
        write_tree(elsewhere, {"entry": "someone's\n"})
        self.assertOk(self.add("--invalidate-cache", cache, "--no-build"))
        journal = read_json(os.path.join(self.state, "journal.json"))
        backup = os.path.join(self.state, journal["entries"][0]["caches"][0]["backup"])
        shutil.rmtree(backup)
        os.symlink(elsewhere, backup)
        self.assertEqual(self.tool("revert"), (
            1, "", "overlay_setup: E203 the backup of %s, %s, is not a directory (a symlink or a "
            "file); the state directory was altered, nothing was changed\n" % (cache, backup)))
        self.assertFalse(os.path.lexists(cache))
        self.assertEqual(read_text(os.path.join(elsewhere, "entry")), "someone's\n")

    def test_a_journal_path_outside_the_recorded_roots_is_refused(self) -> None:
        precious = os.path.join(self.tmp, "elsewhere", "precious.c")
        write_tree(self.tmp, {"elsewhere/precious.c": "keep\n"})
        self.assertOk(self.add("--artifact", os.path.join(self.proj, "build/new.so"),
                               "--no-build"))
        path = os.path.join(self.state, "journal.json")
        journal = read_json(path)
        journal["entries"][0]["artifacts"][0]["path"] = precious
        write_json(path, journal)
        self.assertEqual(self.tool("revert", "--force"), (
            1, "", "overlay_setup: E203 journal %s names %s outside the install roots its entry 1 "
            "recorded (%s); the journal was altered, nothing was changed\n"
            % (path, precious, os.path.join(self.proj, "build"))))
        self.assertEqual(read_text(precious), "keep\n")

    def test_an_artifact_the_build_left_alone_is_not_rewritten(self) -> None:
        tool = os.path.join(self.proj, "tool")
        inode = os.stat(tool).st_ino
        self.assertOk(self.add("--artifact", tool, "--no-build"))
        self.assertOk(self.tool("revert"))
        self.assertEqual(os.stat(tool).st_ino, inode)

    def test_a_245_byte_file_name_round_trips(self) -> None:
        source = os.path.join(self.proj, "k" * 243 + ".c")
        write_text_file(source, "int k;\n")
        before = tree_state(self.proj)
        self.assertOk(self.add("--no-build", source=source))
        self.assertEqual(read_text(source), "int k = 7;\n")
        self.assertOk(self.tool("revert"))
        self.assertEqual(tree_state(self.proj), before)

    def test_a_directory_the_build_removed_is_made_again(self) -> None:
        before = tree_state(self.proj)
        self.assertOk(self.add("--build-cmd", "rm -r build", "--build-cwd", self.proj))
        self.assertFalse(os.path.exists(os.path.join(self.proj, "build")))
        self.assertOk(self.tool("revert"))
        self.assertEqual(tree_state(self.proj), before)

    def test_caches_come_back_even_when_a_file_fails_and_the_failure_names_it(self) -> None:
        cache = os.path.join(self.proj, "cache")
        before = tree_state(self.proj)
        self.assertOk(self.add("--invalidate-cache", cache, "--no-build",
                               "--owner-pid", str(os.getpid())))
        # the 1st write journals that a revert begins, the 2nd restores the source
        failed = forked_tool(["--state", self.state, "revert"], {"OVERLAY_TEST_ENOSPC_AT": "2"})
        self.assertEqual((failed.returncode, failed.stdout), (1, ""))
        self.assertEqual(failed.stderr, "overlay_setup: E601 could not write %s (No space left on "
                                        "device) while reverting; the journal keeps what is left: "
                                        "fix the cause and run `overlay_setup.py --state %s "
                                        "revert` again\n" % (self.source, self.state))
        self.assertEqual(read_text(os.path.join(cache, "entry")), "cached\n")
        self.assertOk(self.tool("revert"))
        self.assertEqual(tree_state(self.proj), before)

    def test_a_cache_that_is_a_mount_point_is_refused_before_anything_changes(self) -> None:
        cache = os.path.join(self.proj, "cache")
        mounted = subprocess.run(["mount", "-t", "tmpfs", "tmpfs", cache],
                                 stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        if mounted.returncode != 0:
            self.skipTest("cannot mount a tmpfs here: %s" % mounted.stdout.decode().strip())
        self.addCleanup(subprocess.run, ["umount", cache])
        before = tree_state(self.proj)
        self.assertEqual(self.add("--invalidate-cache", cache, "--no-build"), (
            1, "", "overlay_setup: E106 --invalidate-cache %s is a mount point, which cannot be "
            "set aside; pass a directory inside it, or unmount it\n" % cache))
        self.assertEqual(tree_state(self.proj), before)

    def test_a_hard_linked_source_comes_back_as_the_same_file(self) -> None:
        other = os.path.join(self.proj, "k_other_name.c")
        os.link(self.source, other)
        inode = os.stat(self.source).st_ino
        self.assertOk(self.add("--no-build"))
        self.assertEqual((read_text(self.source), read_text(other)), ("int k = 7;\n", "int k;\n"))
        self.assertOk(self.tool("revert"))
        self.assertEqual([os.stat(path).st_ino for path in (self.source, other)], [inode, inode])
        self.assertEqual(os.stat(self.source).st_nlink, 2)

    @unittest.skipUnless(shm_available(), "needs /dev/shm on another filesystem than the temp dir")
    def test_a_hard_linked_source_with_the_state_on_another_filesystem_is_refused(self) -> None:
        os.link(self.source, os.path.join(self.proj, "k_other_name.c"))
        self.state = tempfile.mkdtemp(prefix="overlay-state-", dir="/dev/shm")
        self.addCleanup(shutil.rmtree, self.state, True)
        os.rmdir(self.state)
        self.assertEqual(self.add("--no-build"), (
            1, "", "overlay_setup: E106 source %s has 2 hard links, and the state directory %s is "
            "on another filesystem or mount, so revert could not give the links their file back; "
            "pass a --state on the same mount\n" % (self.source, self.state)))

    def test_extended_attributes_acls_and_capabilities_come_back(self) -> None:
        tool = os.path.join(self.proj, "tool")
        wanted = {self.source: {"user.origin": b"vendor", "system.posix_acl_access":
                                acl_granting(65534)},
                  tool: {"user.checked": b"yes"}}
        if os.geteuid() == 0:  # file capabilities need CAP_SETFCAP
            import struct
            wanted[tool]["security.capability"] = struct.pack("<IIIII", 0x02000001, 1 << 13,
                                                              0, 0, 0)
        try:
            for path, attributes in wanted.items():
                for name, value in attributes.items():
                    os.setxattr(path, name, value)
        except OSError as exc:
            self.skipTest("this filesystem does not keep %s: %s" % (name, exc.strerror))
        kept = {path: {name: os.getxattr(path, name) for name in attributes}
                for path, attributes in wanted.items()}
        modes = {path: stat.S_IMODE(os.stat(path).st_mode) for path in wanted}
        self.assertOk(self.add("--artifact", tool, "--build-cmd", "rm tool && cp fast.c tool",
                               "--build-cwd", self.proj))
        self.assertEqual(os.listxattr(tool), [])
        self.assertOk(self.tool("revert"))
        self.assertEqual({path: {name: os.getxattr(path, name) for name in attributes}
                          for path, attributes in wanted.items()}, kept)
        self.assertEqual({path: sorted(os.listxattr(path)) for path in wanted},
                         {path: sorted(attributes) for path, attributes in wanted.items()})
        self.assertEqual({path: stat.S_IMODE(os.stat(path).st_mode) for path in wanted}, modes)

    @unittest.skipUnless(shm_available(), "needs /dev/shm on another filesystem than the temp dir")
    def test_a_sparse_artifact_comes_back_sparse(self) -> None:
        big = os.path.join(self.proj, "big.so")
        with open(big, "wb") as handle:
            handle.write(b"ELF header")
            handle.truncate(1 << 26)  # 64 MiB of holes: far more than any copy buffer
        digest = overlay_setup.file_sha256(big)
        self.state = tempfile.mkdtemp(prefix="overlay-state-", dir="/dev/shm")
        self.addCleanup(shutil.rmtree, self.state, True)
        os.rmdir(self.state)  # the backup crosses filesystems both ways
        self.assertOk(self.add("--artifact", big, "--build-cmd", "rm big.so && echo x > big.so",
                               "--build-cwd", self.proj))
        journal = read_json(os.path.join(self.state, "journal.json"))
        backup = os.path.join(self.state, journal["entries"][0]["artifacts"][0]["backup"])
        self.assertLess(os.stat(backup).st_blocks * 512, 1 << 20)
        self.assertOk(self.tool("revert"))
        self.assertEqual((os.stat(big).st_size, overlay_setup.file_sha256(big)), (1 << 26, digest))
        self.assertLess(os.stat(big).st_blocks * 512, 1 << 20)


class HostileArgumentTest(OverlayTestCase):
    """Arguments that used to end in a traceback: one line, a non-zero exit, nothing written."""

    def setUp(self) -> None:
        super().setUp()
        self.proj = os.path.join(self.tmp, "proj")
        write_tree(self.proj, {"k.c": "int k;\n", "fast.c": "int k = 7;\n"})
        self.source = os.path.join(self.proj, "k.c")

    def add(self, *extra: str) -> tuple:
        return self.tool("add-native", "--source", self.source, "--patched",
                         os.path.join(self.proj, "fast.c"), *extra)

    def test_owner_pid_beyond_any_pid_is_a_usage_error(self) -> None:
        self.assertEqual(self.tool("init", "--owner-pid", "2147483648"), (
            2, "", "overlay_setup: E108 --owner-pid 2147483648 is not a running process; pass the "
            "pid of the process that owns this overlay\n"))

    def test_timeout_that_is_no_finite_number_is_a_usage_error(self) -> None:
        for value in ("nan", "inf", "-inf", "0"):
            with self.subTest(value=value):
                self.assertEqual(self.add("--build-cmd", "true", "--timeout=" + value), (
                    2, "", "overlay_setup: E109 --timeout must be a positive, finite number of "
                    "seconds (got %s)\n" % value))
        self.assertFalse(os.path.exists(self.state))

    def test_endless_patched_file_is_refused_after_a_bounded_read(self) -> None:
        self.assertEqual(self.tool("add-native", "--source", self.source, "--patched",
                                   "/dev/zero", "--no-build"), (
            2, "", "overlay_setup: E102 --patched /dev/zero is larger than 64 MiB (or endless); "
            "pass the patched file\n"))
        patch_rc = self.tool("apply", "/dev/zero", "--root", self.proj, "--no-build")
        self.assertEqual(patch_rc, (
            2, "", "overlay_setup: E102 patch /dev/zero is larger than 64 MiB (or endless); "
            "pass a unified diff\n"))
        self.assertFalse(os.path.exists(self.state))

    def test_ctrl_c_during_start_up_exits_130_without_a_traceback(self) -> None:
        # SIGINT at lines spread over the whole run, from the one after the
        # line that sets the start-up handler (what the interpreter does
        # before the script's first lines no script can change) to the last,
        # under a line tracer that sends the signal at the N-th line the tool
        # executes: the run ends with 130 and no traceback, or at one of its
        # last three lines (the command returned, main flushes and returns;
        # nothing checks for a signal there) it ends as if not interrupted.
        with open(TOOL, encoding="utf-8") as handle:
            handler_line = next(number for number, text in enumerate(handle, 1)
                                if "_signal.signal(_signal.SIGINT" in text)

        def run(at: int) -> subprocess.CompletedProcess:
            shutil.rmtree(self.state, ignore_errors=True)
            return subprocess.run([sys.executable, "-c", INTERRUPT_AT_LINE, TOOL, str(handler_line),
                                   str(at), "--state", self.state, "init", "--owner-pid",
                                   str(os.getpid())], stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE, universal_newlines=True, timeout=60)
        counted = run(0)
        self.assertEqual(counted.returncode, 0, counted.stderr)
        first, last = map(int, counted.stderr.split())
        self.assertGreater(last, first + 100, counted.stderr)
        interrupted = ("overlay_setup: interrupted; run `overlay_setup.py --state %s status`, "
                       "then `overlay_setup.py --state %s revert`\n" % (self.state, self.state))
        for at in sorted({first + (last - first) * i // 15 for i in range(16)}):
            with self.subTest(line_number=at):
                done = run(at)
                if done.returncode == 0 and at > last - 3:
                    self.assertEqual((done.stdout, done.stderr), (counted.stdout, ""))
                    continue
                self.assertEqual(done.returncode, 130, done.stderr)
                self.assertNotIn("Traceback", done.stderr)
                self.assertIn(done.stderr, ("", interrupted))


# Runs the tool (argv[1]) with argv[4:] as its arguments and sends itself
# SIGINT just before the argv[3]-th line of the tool it executes; with 0, it
# writes instead how many lines the run executed and which of them was the
# first after line argv[2] (the one that sets the start-up handler).
INTERRUPT_AT_LINE = """
import os, runpy, signal, sys
tool, handler_line, at = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
sys.argv = [tool] + sys.argv[4:]
lines = [0, 0]
def line(frame, event, arg):
    if event == "line":
        lines[0] += 1
        if not lines[1] and frame.f_code.co_name == "<module>" and frame.f_lineno > handler_line:
            lines[1] = lines[0]
        if lines[0] == at:
            os.kill(os.getpid(), signal.SIGINT)
    return line
if not at:
    import atexit
    atexit.register(lambda: os.write(2, b"%d %d" % (lines[1], lines[0])))
sys.settrace(lambda frame, event, arg: line if frame.f_code.co_filename == tool else None)
runpy.run_path(tool, run_name="__main__")
"""


class BuildProcessTest(OverlayTestCase):
    """The build as a process: when it may start, when it is stopped, how
    long its output is waited for, how its output is shown."""

    def setUp(self) -> None:
        super().setUp()
        self.proj = os.path.join(self.tmp, "proj")
        write_tree(self.proj, {"k.c": "int k;\n", "fast.c": "int k = 7;\n"})
        self.original = tree_state(self.proj)
        self.late = os.path.join(self.proj, "late.o")

    def add_args(self, build_cmd: str) -> list:
        return ["--state", self.state, "add-native", "--source", os.path.join(self.proj, "k.c"),
                "--patched", os.path.join(self.proj, "fast.c"), "--build-cmd", build_cmd,
                "--build-cwd", self.proj]

    def test_a_run_killed_before_its_build_is_journaled_leaves_no_build_running(self) -> None:
        # The kill point just after "building in" is printed is the journal
        # write that records the build process: the build was forked, and
        # must not run until that record is durable.
        build = "sleep 0.3; echo late > late.o"
        point = 0
        while True:
            point += 1
            self.assertLess(point, 100)
            shutil.rmtree(self.state, ignore_errors=True)
            result = forked_tool(self.add_args(build), {"OVERLAY_TEST_KILL_AT": str(point)},
                                 own=True)
            self.assertEqual(result.returncode, -9, result.stderr)
            if "building in" in result.stdout:
                break
            self.assertOk(call("--state", self.state, "revert"))
        self.assertNotIn("process", read_json(self.state + "/journal.json")["entries"][0]["build"])
        rc, out, err = call("gc-stale")
        self.assertEqual(rc, 0, err)
        self.assertIn("): reverted\n", out)
        self.assertEqual(wait_for_no_process_in(self.proj), [])
        self.assertFalse(os.path.exists(self.late))
        self.assertEqual(tree_state(self.proj), self.original)

    def test_a_process_one_reading_of_proc_missed_is_still_the_build(self) -> None:
        # One reading of /proc misses a process forked while it ran by a
        # parent gone before its turn (the assembler a compiler driver starts
        # as it is stopped): the build is gone only when a second reading
        # finds none of it either.
        member = ["S", "1", "4242", "4242"]  # state, ppid, process group, session
        readings = iter([[], [(4243, member)], [], [(4243, member)], [], []])
        with unittest.mock.patch.object(overlay_setup, "live_process_stats",
                                        lambda: next(readings)):
            self.assertEqual([overlay_setup.group_alive(4242) for _ in range(3)],
                             [True, True, False])

    def test_sigterm_and_sighup_stop_the_build_with_the_run(self) -> None:
        for name, number in (("SIGTERM", signal.SIGTERM), ("SIGHUP", signal.SIGHUP)):
            with self.subTest(signal=name):
                shutil.rmtree(self.state, ignore_errors=True)
                result = forked_tool(self.add_args("kill -%s $PPID; sleep 1; echo late > late.o"
                                                % name[3:]), own=True)
                self.assertEqual(result.returncode, 128 + number, result.stderr)
                self.assertEqual(result.stderr, "overlay_setup: stopped by %s; the build was "
                                 "stopped with it and the patch stays applied: run "
                                 "`overlay_setup.py --state %s revert`\n" % (name, self.state))
                self.assertEqual(wait_for_no_process_in(self.proj), [])
                self.assertFalse(os.path.exists(self.late))
                self.assertOk(call("--state", self.state, "revert"))
                self.assertEqual(tree_state(self.proj), self.original)

    def test_a_helper_left_holding_the_output_is_not_waited_for_past_the_limit(self) -> None:
        # A compile server started by the build keeps the build's stdout open.
        # The run is a fork that reads on for 0.2 s after the build exited,
        # not for OUTPUT_GRACE's 2 s, and waits for the helper 0.5 s more,
        # not LINGER_LIMIT's 10 s, before it stops it.
        helper_pid = os.path.join(self.tmp, "helper.pid")
        build = "sh -c 'echo $$ > %s; exec sleep 60' & echo built" % helper_pid

        def stop_helper() -> None:
            with contextlib.suppress(OSError, ValueError):
                os.kill(int(read_text(helper_pid)), signal.SIGKILL)
        self.addCleanup(stop_helper)
        grace, overlay_setup.OUTPUT_GRACE = overlay_setup.OUTPUT_GRACE, 0.2
        limit, overlay_setup.LINGER_LIMIT = overlay_setup.LINGER_LIMIT, 0.5
        try:
            run = forked_tool(self.add_args(build) + ["--owner-pid", str(os.getpid())])
        finally:
            overlay_setup.OUTPUT_GRACE, overlay_setup.LINGER_LIMIT = grace, limit
        self.assertEqual(run.returncode, 0, run.stderr)
        self.assertRegex(run.stdout, r"\] built\n")
        pid = int(read_text(helper_pid))
        self.assertEqual(run.stderr, "warning: the build exited, but a process it started still "
                                     "holds its output open; its output is no longer shown\n"
                                     "warning: the build's shell exited, but process %d (sleep) "
                                     "of its process group still ran 0.5s later; it was stopped, "
                                     "and the build taken as over\n" % pid)
        self.assertNotIn(pid, [live for live, _ in overlay_setup.live_process_stats()])
        self.assertOk(call("--state", self.state, "revert"))

    def test_output_without_newlines_is_shown_as_it_comes(self) -> None:
        done = os.path.join(self.tmp, "build-done")
        go = os.path.join(self.tmp, "go")  # the build goes on once the first step was seen
        build = "printf 'step 1/2\\r'; until [ -e %s ]; do sleep 0.01; done; printf 'step 2/2\\r'; " \
                "touch %s" % (go, done)
        process = subprocess.Popen([sys.executable, TOOL] + self.add_args(build)
                                   + ["--owner-pid", str(os.getpid())],
                                   stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        self.addCleanup(process.kill)
        shown = b""
        while b"] step 1/2" not in shown:
            block = os.read(process.stdout.fileno(), 4096)
            self.assertTrue(block, shown)
            shown += block
        self.assertFalse(os.path.exists(done), "shown only when the build ended")
        write_text_file(go, "")
        out, err = process.communicate(timeout=60)
        self.assertEqual(process.returncode, 0, err)
        self.assertRegex((shown + out).decode(),
                         r"\] step 1/2\n\[ *[0-9.]+s\] step 2/2\nbuild finished")
        self.assertOk(call("--state", self.state, "revert"))

    def test_output_without_newlines_is_held_in_bounded_memory(self) -> None:
        # The peak memory of a run whose build prints 32 MiB without a line
        # end, against one whose build prints a line: the same, within 16 MiB.
        measure = ("import resource, subprocess, sys; "
                   "subprocess.run(sys.argv[1:], stdout=subprocess.DEVNULL, check=True); "
                   "print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)")
        peaks = []
        for build in ("echo one line", "head -c 33554432 /dev/zero | tr '\\0' x"):
            shutil.rmtree(self.state, ignore_errors=True)
            peak = subprocess.run([sys.executable, "-c", measure, sys.executable, TOOL]
                                  + self.add_args(build) + ["--owner-pid", str(os.getpid())],
                                  stdout=subprocess.PIPE, universal_newlines=True, check=True)
            peaks.append(int(peak.stdout) * 1024)
            self.assertOk(call("--state", self.state, "revert"))
        self.assertLess(peaks[1] - peaks[0], 16 << 20, peaks)


def mount_or_skip(test: unittest.TestCase, *args: str) -> None:
    """Run mount(8) (root only here); skip the test saying why when it cannot."""
    if os.geteuid() != 0:
        test.skipTest("mounting needs root, which this run is not")
    result = subprocess.run(["mount"] + list(args), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, universal_newlines=True)
    if result.returncode != 0:
        test.skipTest("mount %s failed: %s" % (" ".join(args), result.stdout.strip()))


class MountTest(OverlayTestCase):
    """Real mounts: a read-only state directory, a bind mount, a full disk."""

    def setUp(self) -> None:
        super().setUp()
        self.proj = os.path.join(self.tmp, "proj")
        write_tree(self.proj, {"k.c": "int k;\n", "fast.c": "int k = 7;\n"})
        self.source = os.path.join(self.proj, "k.c")

    def mount(self, *args: str) -> None:
        mount_or_skip(self, *args)
        self.addCleanup(subprocess.run, ["umount", "-l", args[-1]])

    def test_status_of_a_read_only_state_directory_is_shown_whole(self) -> None:
        self.assertOk(self.tool("add-native", "--source", self.source, "--patched",
                                os.path.join(self.proj, "fast.c"), "--no-build",
                                "--owner-pid", str(os.getpid())))
        writable = self.tool("status")
        self.assertOk(writable)
        self.mount("--bind", self.state, self.state)
        self.mount("-o", "remount,bind,ro", self.state)
        self.assertEqual(self.tool("status"), writable)


    def test_a_full_disk_names_the_file_it_could_not_write(self) -> None:
        small = os.path.join(self.tmp, "small")
        os.mkdir(small)
        self.mount("-t", "tmpfs", "-o", "size=1m", "tmpfs", small)
        artifact = os.path.join(self.proj, "big.so")
        with open(artifact, "wb") as handle:
            handle.write(os.urandom(3 << 20))
        before = tree_state(self.proj)
        state = os.path.join(small, "state")
        self.assertEqual(call("--state", state, "add-native", "--source", self.source,
                              "--patched", os.path.join(self.proj, "fast.c"), "--artifact",
                              artifact, "--no-build", "--owner-pid", str(os.getpid())), (
            1, "", "overlay_setup: E601 could not write %s/backups/1/a0 (No space left on "
            "device); nothing stays applied: fix the cause and run the command again\n" % state))
        self.assertEqual(tree_state(self.proj), before)

    def bound_copy(self) -> tuple:
        """(real, bound): a folder and a bind mount of it, one filesystem
        and device, two mounts."""
        real, bound = os.path.join(self.tmp, "real"), os.path.join(self.tmp, "bound")
        os.mkdir(real)
        os.mkdir(bound)
        self.mount("--bind", real, bound)
        self.assertEqual(os.stat(real).st_dev, os.stat(bound).st_dev)
        return real, bound

    def test_a_cache_on_a_bind_mount_of_the_state_filesystem_round_trips(self) -> None:
        real, bound = self.bound_copy()
        write_tree(real, {"cache/a": "A\n", "cache/sub/b": "B\n"})
        before = (tree_state(self.proj), tree_state(real))
        cache = os.path.join(bound, "cache")
        # A rename between the two mounts fails (EXDEV): it was E601 after a
        # rollback; the cache is snapshotted as one on another filesystem is.
        rc, out, err = self.tool("add-native", "--source", self.source, "--patched",
                                 os.path.join(self.proj, "fast.c"), "--invalidate-cache", cache,
                                 "--no-build", "--owner-pid", str(os.getpid()))
        self.assertEqual((rc, err), (0, ""))
        self.assertFalse(os.path.exists(cache))
        self.assertEqual(read_json(os.path.join(self.state, "journal.json"))["entries"][0][
            "caches"][0]["method"], "tar")
        self.assertOk(self.tool("revert"))
        self.assertEqual((tree_state(self.proj), tree_state(real)), before)

    def test_a_hard_linked_source_with_the_state_on_a_bind_mount_is_refused(self) -> None:
        real, bound = self.bound_copy()
        write_tree(real, {"k.c": "int k;\n"})
        source = os.path.join(bound, "k.c")
        os.link(source, os.path.join(bound, "k_other_name.c"))
        before = tree_state(real)
        self.assertEqual(self.tool("add-native", "--source", source, "--patched",
                                   os.path.join(self.proj, "fast.c"), "--no-build",
                                   "--owner-pid", str(os.getpid())), (
            1, "", "overlay_setup: E106 source %s has 2 hard links, and the state directory %s "
            "is on another filesystem or mount, so revert could not give the links their file "
            "back; pass a --state on the same mount\n" % (source, self.state)))
        self.assertEqual(tree_state(real), before)

    def test_a_cache_that_is_a_bind_mount_of_the_same_filesystem_is_refused(self) -> None:
        cache = os.path.join(self.proj, "cache")
        write_tree(self.tmp, {"elsewhere/a": "A\n"})
        os.mkdir(cache)
        self.mount("--bind", os.path.join(self.tmp, "elsewhere"), cache)
        before = tree_state(self.proj)
        self.assertEqual(self.tool("add-native", "--source", self.source, "--patched",
                                   os.path.join(self.proj, "fast.c"), "--invalidate-cache", cache,
                                   "--no-build", "--owner-pid", str(os.getpid())), (
            1, "", "overlay_setup: E106 --invalidate-cache %s is a mount point, which cannot be "
            "set aside; pass a directory inside it, or unmount it\n" % cache))
        self.assertEqual(tree_state(self.proj), before)


def runs_as_nobody(command: list) -> bool:
    return subprocess.run(["runuser", "-u", "nobody", "--"] + command, stdout=subprocess.DEVNULL,
                          stderr=subprocess.DEVNULL).returncode == 0


def nobody_python(test: unittest.TestCase) -> str:
    """A Python interpreter that user nobody may run, to run the tool as a
    second user; the test is skipped, saying why, where there is none."""
    if os.geteuid() != 0 or shutil.which("runuser") is None:
        test.skipTest("running the tool as a second user needs root and runuser")
    python = next((path for path in (sys.executable, "/usr/bin/python3")
                   if runs_as_nobody([path, "-c", "pass"])), None)
    if python is None:
        test.skipTest("no Python interpreter here that user nobody may run")
    return python


class TwoOverlaysTest(OverlayTestCase):
    """A source that an applied overlay holds is held for every state
    directory and every user: the claim beside it says by whom."""

    def test_a_source_held_by_a_state_another_registry_lists_is_refused_naming_it(self) -> None:
        proj = os.path.join(self.tmp, "proj")
        write_tree(proj, {"k.c": "int k;\n", "one.c": "int k = 1;\n", "two.c": "int k = 2;\n"})
        source = os.path.join(proj, "k.c")
        original = tree_state(proj)
        older, newer = os.path.join(self.tmp, "older"), os.path.join(self.tmp, "newer")
        home = os.environ["XDG_STATE_HOME"]
        results = []
        for state, patched in ((older, "one.c"), (newer, "two.c")):
            # two registries: one does not know the other's journal
            os.environ["XDG_STATE_HOME"] = state + "-home"
            results.append(call("--state", state, "add-native", "--source", source, "--patched",
                                os.path.join(proj, patched), "--no-build",
                                "--owner-pid", str(os.getpid())))
        os.environ["XDG_STATE_HOME"] = home
        self.assertOk(results[0])
        self.assertEqual(results[1], (
            1, "", "overlay_setup: E124 --source %s is held by the overlay at %s (entry 1) of "
            "user %s (uid %d), as %s says; nothing was changed: revert that one first "
            "(`overlay_setup.py --state %s revert`, as %s)\n"
            % (source, older, pwd.getpwuid(os.geteuid()).pw_name, os.geteuid(),
               os.path.join(proj, ".k.c.overlay-claim"), older,
               pwd.getpwuid(os.geteuid()).pw_name)))
        self.assertEqual(read_text(source), "int k = 1;\n")
        self.assertOk(call("--state", older, "revert"))
        self.assertEqual(tree_state(proj), original)
        self.assertOk(call("--state", newer, "add-native", "--source", source, "--patched",
                           os.path.join(proj, "two.c"), "--no-build"))
        self.assertOk(call("--state", newer, "revert"))
        self.assertEqual(tree_state(proj), original)

    def test_an_artifact_another_state_builds_is_refused_naming_its_holder(self) -> None:
        # Two overlays rebuilding one library: reverted in either order, one
        # would put back a library without the other's patch.
        proj = self.built_project(MAKE_PROJECT)
        write_tree(self.tmp, {"fast_a.c": MAKE_PROJECT["a.c"].replace("1", "2"),
                              "fast_b.c": MAKE_PROJECT["b.c"].replace("K;", "K + 1;")})
        library = os.path.join(proj, "libk.so")
        original = tree_state(proj)
        other = os.path.join(self.tmp, "other")
        for state, source in ((self.state, "a.c"), (other, "b.c")):
            os.environ["XDG_STATE_HOME"] = state + "-home"  # registries that do not meet
            results = call("--state", state, "add-native", "--source", os.path.join(proj, source),
                           "--patched", os.path.join(self.tmp, "fast_" + source), "--artifact",
                           library, "--build-cmd", "make", "--build-cwd", proj)
        self.assertEqual(results, (
            1, "", "overlay_setup: E124 --artifact %s is held by the overlay at %s (entry 1) of "
            "user %s (uid %d), as %s says; nothing was changed: revert that one first "
            "(`overlay_setup.py --state %s revert`, as %s)\n"
            % (library, self.state, pwd.getpwuid(os.geteuid()).pw_name, os.geteuid(),
               os.path.join(proj, ".libk.so.overlay-claim"), self.state,
               pwd.getpwuid(os.geteuid()).pw_name)))
        self.assertEqual(read_text(os.path.join(proj, "b.c")), MAKE_PROJECT["b.c"])
        os.environ["XDG_STATE_HOME"] = self.state + "-home"
        self.assertOk(self.tool("revert"))
        self.assertEqual(tree_state(proj), original)

    def test_a_stale_claim_whose_overlay_is_gone_is_no_hold(self) -> None:
        proj = os.path.join(self.tmp, "proj")
        write_tree(proj, {"k.c": "int k;\n", "one.c": "int k = 1;\n"})
        original = tree_state(proj)
        write_text_file(os.path.join(proj, ".k.c.overlay-claim"), json.dumps(
            {"state": os.path.join(self.tmp, "gone"), "uid": os.geteuid(), "entry": 1}))
        self.assertOk(self.tool("add-native", "--source", os.path.join(proj, "k.c"),
                                "--patched", os.path.join(proj, "one.c"), "--no-build"))
        self.assertOk(self.tool("revert"))
        self.assertEqual(tree_state(proj), original)

    def test_another_users_overlay_of_a_source_is_refused_both_ways(self) -> None:
        python = nobody_python(self)
        os.chmod(self.tmp, 0o755)
        proj = os.path.join(self.tmp, "proj")
        write_tree(proj, {"k.c": "int k;\n", "one.c": "int k = 1;\n", "two.c": "int k = 2;\n"})
        theirs = os.path.join(self.tmp, "nobody")
        os.makedirs(theirs)
        for directory in (proj, theirs):
            for path in [directory] + [os.path.join(directory, name)
                                       for name in os.listdir(directory)]:
                os.chown(path, 65534, 65534)
        original = tree_state(proj)
        source = os.path.join(proj, "k.c")

        def as_nobody(*argv: str) -> subprocess.CompletedProcess:
            return subprocess.run(
                ["runuser", "-u", "nobody", "--", "env", "XDG_STATE_HOME=" + theirs, python,
                 TOOL, "--state", os.path.join(theirs, "state")] + list(argv),
                stdout=subprocess.PIPE, stderr=subprocess.PIPE, universal_newlines=True,
                cwd=theirs)
        add = ["add-native", "--source", source, "--no-build", "--patched"]
        self.assertOk(self.tool(*add, os.path.join(proj, "one.c")))
        refused = as_nobody(*add, os.path.join(proj, "two.c"))
        self.assertEqual((refused.returncode, refused.stderr), (
            1, "overlay_setup: E124 --source %s is held by the overlay at %s (entry 1) of user "
            "root (uid 0), as %s says; nothing was changed: revert that one first "
            "(`overlay_setup.py --state %s revert`, as root)\n"
            % (source, self.state, os.path.join(proj, ".k.c.overlay-claim"), self.state)))
        self.assertOk(self.tool("revert"))
        self.assertEqual(tree_state(proj), original)
        applied = as_nobody(*add, os.path.join(proj, "two.c"))
        self.assertEqual(applied.returncode, 0, applied.stderr)
        rc, out, err = self.tool(*add, os.path.join(proj, "one.c"))
        self.assertEqual((rc, err.split(" is held by ")[0]), (
            1, "overlay_setup: E124 --source %s" % source))
        self.assertIn("of user nobody (uid 65534)", err)
        self.assertEqual(read_text(source), "int k = 2;\n")
        reverted = as_nobody("revert")
        self.assertEqual(reverted.returncode, 0, reverted.stderr)
        self.assertEqual(tree_state(proj), original)

    def test_a_revert_never_writes_over_a_source_another_overlay_applied_during_its_build(
            self) -> None:
        # B applies b.c while A's build runs: A's build sees b.c change, but
        # b.c is B's; A's revert leaves it, B's gives back the original.
        proj = self.built_project(MAKE_PROJECT)
        write_tree(self.tmp, {"fast_a.c": MAKE_PROJECT["a.c"].replace("1", "2"),
                              "fast_b.c": MAKE_PROJECT["b.c"].replace("K;", "K + 1;")})
        original = tree_state(proj)
        other = os.path.join(self.tmp, "other")
        apply_other = " ".join([sys.executable, TOOL, "--state", other, "add-native", "--source",
                                os.path.join(proj, "b.c"), "--patched",
                                os.path.join(self.tmp, "fast_b.c"), "--no-build",
                                "--owner-pid", str(os.getpid())])
        self.assertOk(self.tool("add-native", "--source", os.path.join(proj, "a.c"), "--patched",
                                os.path.join(self.tmp, "fast_a.c"), "--artifact",
                                os.path.join(proj, "libk.so"), "--build-cmd",
                                apply_other + " && make", "--build-cwd", proj,
                                "--owner-pid", str(os.getpid())))
        self.assertEqual(read_text(os.path.join(proj, "b.c")), read_text(
            os.path.join(self.tmp, "fast_b.c")))
        rc, out, err = self.tool("revert")
        self.assertEqual(rc, 0, err)
        self.assertIn("entry 1: left %s as it is: the overlay at %s holds it\n"
                      % (os.path.join(proj, "b.c"), other), err)
        self.assertEqual(read_text(os.path.join(proj, "b.c")), read_text(
            os.path.join(self.tmp, "fast_b.c")))
        rc, out, _ = call("--state", other, "status")
        self.assertIn("  source %s\n" % os.path.join(proj, "b.c"), out)
        self.assertOk(call("--state", other, "revert"))
        self.assertEqual(read_text(os.path.join(proj, "b.c")), MAKE_PROJECT["b.c"])
        self.assertEqual(read_text(os.path.join(proj, "a.c")), MAKE_PROJECT["a.c"])
        self.assertNotIn(".b.c.overlay-claim", os.listdir(proj))
        self.assertEqual(original["b.c"], tree_state(proj)["b.c"])


OUT_PROJECT = {
    "k.c": "int k(void) { return 1; }\n",
    "Makefile": "out/libk.so: k.c\n\tmkdir -p out && $(CC) -shared -fPIC -o $@ k.c\n",
}


class RevertEndsTest(OverlayTestCase):
    """Every revert ends: whatever shape the build left a recorded change in,
    and whatever became of the install since the apply."""

    def setUp(self) -> None:
        super().setUp()
        self.proj = self.built_project(OUT_PROJECT)
        self.fast = os.path.join(self.tmp, "fast.c")
        write_text_file(self.fast, "int k(void) { return 2; }\n")
        self.before = tree_state(self.proj)

    def apply(self, build: str = "make") -> None:
        self.assertOk(self.tool("add-native", "--source", os.path.join(self.proj, "k.c"),
                                "--patched", self.fast, "--artifact",
                                os.path.join(self.proj, "out", "libk.so"), "--build-cmd", build,
                                "--build-cwd", self.proj))

    def test_a_product_folder_the_build_turned_into_a_symlink_comes_back(self) -> None:
        self.apply("mv out out-1 && ln -s out-1 out && make")
        self.assertTrue(os.path.islink(os.path.join(self.proj, "out")))
        rc, out, err = self.tool("revert")
        self.assertEqual((rc, err), (0, ""))
        self.assertEqual(tree_state(self.proj), self.before)

    def test_a_clock_behind_the_install_is_named_as_a_timestamp_problem(self) -> None:
        # The install's files dated after now (built where the clock was ahead,
        # or this clock is behind): the patched source looks older than its
        # library, and make rebuilds nothing.
        ahead = time.time() + 86400
        library = os.path.join(self.proj, "out", "libk.so")
        os.utime(library, (ahead, ahead))
        rc, out, err = self.tool("add-native", "--source", os.path.join(self.proj, "k.c"),
                                 "--patched", self.fast, "--artifact", library,
                                 "--build-cmd", "make", "--build-cwd", self.proj)
        self.assertEqual(rc, 1)
        self.assertEqual(err, "overlay_setup: E404 the build finished in %.1fs but changed no "
                              "--artifact (%s): the patch is not in them; it stays applied for "
                              "inspection: %s is dated %s, after the patched source %s was "
                              "written: this machine's clock is behind the install's timestamps, "
                              "so the build found nothing newer to rebuild; set the clock right "
                              "(or `touch` the install's files to now), then run "
                              "`overlay_setup.py --state %s update`, or run `overlay_setup.py "
                              "--state %s revert`\n"
                         % (float(re.search(r"finished in ([0-9.]+)s", err).group(1)), library,
                            library, time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(ahead)),
                            os.path.join(self.proj, "k.c"), self.state, self.state))
        self.assertOk(self.tool("revert"))

    def test_an_install_removed_since_the_apply_closes_the_entry_and_writes_nothing(
            self) -> None:
        for force in ([], ["--force"]):
            with self.subTest(force=force):
                self.apply()
                shutil.rmtree(self.proj)
                rc, out, err = self.tool("revert", *force)
                self.assertEqual((rc, err), (0, ""))
                self.assertIn("entry 1 closed: %s is gone since the apply (the install was "
                              "removed); nothing of the old install was written back\n"
                              % self.proj, out)
                self.assertFalse(os.path.exists(self.proj))
                self.assertEqual(read_json(os.path.join(self.state, "journal.json"))["entries"],
                                 [])
                self.proj = self.built_project(OUT_PROJECT)

    def test_an_install_uninstalled_file_by_file_closes_the_entry_and_writes_nothing(
            self) -> None:
        # pip uninstall removes the files its RECORD lists, one by one: the
        # folder stays while anything else (the claim) is in it.
        for force in ([], ["--force"]):
            with self.subTest(force=force):
                self.apply()
                for directory, _, files in os.walk(self.proj):
                    for name in files:
                        if not name.endswith(".overlay-claim"):
                            os.unlink(os.path.join(directory, name))
                rc, out, err = self.tool("revert", *force)
                self.assertEqual((rc, err), (0, ""))
                self.assertIn("entry 1 closed: %s is gone since the apply (the install was "
                              "removed); nothing of the old install was written back\n"
                              % os.path.join(self.proj, "k.c"), out)
                self.assertEqual(sorted(os.listdir(self.proj)), ["out"])
                self.assertEqual(os.listdir(os.path.join(self.proj, "out")), [])
                shutil.rmtree(self.proj)
                self.proj = self.built_project(OUT_PROJECT)

    def test_an_install_upgraded_since_the_apply_keeps_the_new_version(self) -> None:
        for force in ([], ["--force"]):
            with self.subTest(force=force):
                self.apply()
                # as pip upgrades: the old folder stashed aside, the new one written
                old = self.proj + ".old"
                os.rename(self.proj, old)
                write_tree(self.proj, dict(OUT_PROJECT, **{"k.c": "int k(void) { return 3; }\n"}))
                quiet(["make"], self.proj).check_returncode()
                shutil.rmtree(old)
                upgraded = tree_state(self.proj)
                self.assertIn("entry 1: built (the build exited 0 after", self.tool("status")[1])
                self.assertIn("\n  install gone: %s is another folder than the one patched (the "
                              "install was replaced, as an upgrade does); revert closes the "
                              "entry and writes nothing of the old install\n" % self.proj,
                              self.tool("status")[1])
                rc, out, err = self.tool("revert", *force)
                self.assertEqual((rc, err), (0, ""))
                self.assertIn("entry 1 closed: %s is another folder than the one patched (the "
                              "install was replaced, as an upgrade does); nothing of the old "
                              "install was written back\n" % self.proj, out)
                self.assertEqual(tree_state(self.proj), upgraded)
                shutil.rmtree(self.proj)
                self.proj = self.built_project(OUT_PROJECT)


class OverlayModelTest(OverlayTestCase):
    """Seeded random sequences on a real make project, checked after every
    step against a model of what the install must hold: two overlays (each
    its own state directory and registry) apply, update, revert, die with
    their owner for gc-stale, are killed at a random mutation, while the
    user edits files and the install is upgraded under them.  The model: a
    source holds its overlay's content, else the install's; claims are
    exactly the held sources'; what the user wrote survives; with nothing
    applied the install is byte-exact what it was (edits and upgrades
    included).  Deterministic from the seed; bench/overlay_state_machine.py
    runs long sequences of many seeds."""

    SOURCES = ("a.c", "b.c")
    OVERLAYS = ("A", "B")

    run_sequence_only = None  # (seed, steps): bench/overlay_state_machine.py's one long run

    def test_seeded_sequences_keep_the_model(self) -> None:
        if self.run_sequence_only:
            self.run_sequence(*self.run_sequence_only)
            return
        # 16: an upgrade into a folder that reuses the patched one's inode;
        # 73: two overlays rebuilding one library, reverted in turn.
        for seed, steps in ((16, 20), (73, 40), (1, 14)):
            with self.subTest(seed=seed):
                self.run_sequence(seed, steps)

    def run_sequence(self, seed: int, steps: int) -> None:
        """`steps` random steps from `seed` on a fresh copy of the project;
        fails naming the seed, the step and the steps so far."""
        rng = random.Random(seed)
        root = os.path.join(self.tmp, "seed%d" % seed)
        self.proj = self.built_copy(os.path.join(root, "proj"), MAKE_PROJECT, ["make"], aged=True)
        self.root, self.rng, self.rng_seed, self.log = root, rng, seed, []
        os.makedirs(os.path.join(root, "states"))
        self.owners: dict = {}
        self.base = {source: MAKE_PROJECT[source] for source in self.SOURCES}
        self.held: dict = {}  # overlay -> [source, content]
        self.order: list = []  # overlays by their last build, oldest first
        self.gone: set = set()  # overlays whose install an upgrade replaced
        self.notes: dict = {}
        self.baseline = self.install_state()
        steps_of = [self.step_apply, self.step_update, self.step_revert, self.step_edit,
                    self.step_upgrade, self.step_kill_apply, self.step_owner_dies]
        for number in range(steps):
            step = rng.choice(steps_of)
            self.log.append(step.__name__[5:])
            step()
            self.check("after step %d" % number)
        for name in reversed(self.order + sorted(self.gone)):
            if name in self.held:
                self.expect_revert(name)
        self.check("after the final reverts")

    # -- the tool and the model

    def where(self, what: str) -> str:
        return "seed %d, %s; steps: %s\n" % (self.rng_seed, what, " ".join(self.log))

    def tool_as(self, name: str, *argv: str, kill_at: int = None):
        env = {"XDG_STATE_HOME": os.path.join(self.root, "home-" + name)}
        if kill_at is not None:
            env["OVERLAY_TEST_KILL_AT"] = str(kill_at)
        done = forked_tool(["--state", os.path.join(self.root, "states", name)] + list(argv),
                           env)
        self.assertNotIn("Traceback", done.stderr, self.where(" ".join(argv)))
        return done

    def owner(self, name: str) -> int:
        process = self.owners.get(name)
        if process is None or process.poll() is not None:
            process = subprocess.Popen(["sleep", "3600"])
            self.addCleanup(process.wait)
            self.addCleanup(process.kill)
            self.owners[name] = process
        return process.pid

    def install_state(self) -> dict:
        return {path: info for path, info in tree_state(self.proj).items()
                if path.split("/")[0] != "notes"}

    def expected(self, source: str) -> str:
        for name, (held, content) in self.held.items():
            if held == source and name not in self.gone:
                return content
        return self.base[source]

    def check(self, when: str) -> None:
        where = self.where(when)
        for source in self.SOURCES:
            self.assertEqual(read_text(os.path.join(self.proj, source)), self.expected(source),
                             where)
        claims = sorted(name for name in os.listdir(self.proj) if name.endswith(".overlay-claim"))
        self.assertEqual(claims, sorted(".%s.overlay-claim" % path for name, (held, _) in
                                        self.held.items() if name not in self.gone
                                        for path in (held, "libk.so")), where)
        self.assertEqual([name for name in os.listdir(self.proj)
                          if name.startswith(overlay_setup.TEMP_PREFIX)], [], where)
        for path, content in self.notes.items():
            self.assertEqual(read_text(path), content, where)
        if not self.held:
            self.assertEqual(self.install_state(), self.baseline, where)

    def patched(self, source: str) -> str:
        content = self.base[source].replace("return", "return %d +" % self.rng.randint(2, 99), 1)
        path = os.path.join(self.root, "patched-%d.c" % len(self.log))
        write_text_file(path, content)
        return path

    def expect_revert(self, name: str) -> None:
        self.log.append("revert:" + name)
        done = self.tool_as(name, "revert")
        where = self.where("revert " + name)
        if name in self.gone:
            self.assertEqual(done.returncode, 0, where + done.stderr)
            self.assertIn("closed:", done.stdout, where)
        elif self.order[-1:] != [name]:  # another's build rewrote the library since
            self.assertEqual(done.returncode, 1, where + done.stderr)
            self.assertIn("E509", done.stderr, where)
            return
        else:
            self.assertEqual((done.returncode, done.stderr), (0, ""), where)
            self.order.remove(name)
        self.gone.discard(name)
        del self.held[name]

    # -- the steps

    def step_apply(self, kill_at: int = None) -> None:
        name = self.rng.choice(self.OVERLAYS)
        source = self.rng.choice(self.SOURCES)
        if name in self.held:
            return
        if not self.held:
            self.baseline = self.install_state()
        patched = self.patched(source)
        done = self.tool_as(name, "add-native", "--source", os.path.join(self.proj, source),
                            "--patched", patched, "--artifact",
                            os.path.join(self.proj, "libk.so"), "--build-cmd", "make",
                            "--build-cwd", self.proj, "--owner-pid", str(self.owner(name)),
                            kill_at=kill_at)
        self.log[-1] += ":%s:%s%s" % (name, source, "" if kill_at is None else "@%d" % kill_at)
        where = self.where("apply %s %s" % (name, source))
        if any(other not in self.gone for other in self.held):  # it holds libk.so
            if done.returncode == -9:  # killed before its refusal: nothing to recover
                self.assertEqual(self.tool_as(name, "revert").returncode, 0, where)
                return
            self.assertEqual(done.returncode, 1, where + done.stderr)
            self.assertRegex(done.stderr, "E12[04]", where)
            return
        if done.returncode == -9:  # killed: the next command recovers it
            self.log[-1] += ":killed"
            recovered = self.tool_as(name, "revert")
            self.assertIn(recovered.returncode, (0,), where + recovered.stderr)
            return
        self.assertEqual(done.returncode, 0, where + done.stderr)
        self.held[name] = [source, read_text(patched)]
        self.order.append(name)

    def step_kill_apply(self) -> None:
        self.step_apply(kill_at=self.rng.randint(1, 40))

    def step_update(self) -> None:
        name = self.rng.choice(self.OVERLAYS)
        if name not in self.held or name in self.gone:
            return
        source = self.held[name][0]
        patched = self.patched(source)
        self.log[-1] += ":" + name
        if name not in self.owners:  # its owner is gone: another may not add to it
            done = self.tool_as(name, "update", "--patched", patched, "--owner-pid",
                                str(self.owner(name)))
            self.assertEqual(done.returncode, 1, self.where("update " + name) + done.stderr)
            self.assertIn("E205", done.stderr)
            return
        done = self.tool_as(name, "update", "--patched", patched, "--owner-pid",
                            str(self.owner(name)))
        self.assertEqual(done.returncode, 0, self.where("update " + name) + done.stderr)
        self.held[name][1] = read_text(patched)
        self.order.remove(name)
        self.order.append(name)

    def step_revert(self) -> None:
        name = self.rng.choice(self.OVERLAYS)
        if name in self.held:
            self.expect_revert(name)

    def step_edit(self) -> None:
        """The user writes a note into the install, or, with nothing applied,
        edits a source and builds (its own version from now on).  An edit
        left unbuilt under an overlay is not modelled: the overlay's build
        then rebuilds that object too, with no backup, and revert rightly
        says E506."""
        if not self.held and self.rng.random() < 0.5:
            source = self.rng.choice(self.SOURCES)
            self.log[-1] += ":" + source
            self.base[source] = self.base[source] + "/* edit %d */\n" % len(self.log)
            write_text_file(os.path.join(self.proj, source), self.base[source])
            quiet(["make"], self.proj).check_returncode()
            self.baseline = self.install_state()
            return
        path = os.path.join(self.proj, "notes", "n%d.txt" % len(self.log))
        os.makedirs(os.path.dirname(path), exist_ok=True)
        self.notes[path] = "note %d\n" % self.rng.randint(0, 1000)
        write_text_file(path, self.notes[path])

    def step_upgrade(self) -> None:
        """A new version replaces the install's folder, as pip does."""
        old = self.proj + ".old"
        os.rename(self.proj, old)
        version = dict(MAKE_PROJECT, **{"k.h": MAKE_PROJECT["k.h"].replace(
            "4", str(self.rng.randint(5, 99)))})
        write_tree(self.proj, version)
        quiet(["make"], self.proj).check_returncode()
        shutil.rmtree(old)
        self.base = {source: version[source] for source in self.SOURCES}
        self.notes = {}
        self.gone |= set(self.held)
        self.order = []
        self.baseline = self.install_state()

    def step_owner_dies(self) -> None:
        """An owner ends; gc-stale reverts what it owned, newest build first."""
        name = self.rng.choice(self.OVERLAYS)
        self.log[-1] += ":" + name
        process = self.owners.pop(name, None)
        if process is not None:
            process.kill()
            process.wait()
        dead = [other for other in self.OVERLAYS if other in self.held
                and other not in self.owners]
        done = forked_tool(["gc-stale", "--root", os.path.join(self.root, "states")])
        where = self.where("gc-stale")
        self.assertNotIn("Traceback", done.stderr, where)
        failed = False
        for other in sorted(dead):  # gc-stale's order
            if other not in self.gone and self.order[-1:] != [other]:
                failed = True
                continue
            self.order = [one for one in self.order if one != other]
            self.gone.discard(other)
            del self.held[other]
        self.assertEqual(done.returncode, 1 if failed else 0, where + done.stderr)


class ClaimRaceTest(OverlayTestCase):
    """Two state directories claiming one source at the same moment: real
    processes, both loaded and waiting on one pipe, released together."""

    def test_two_state_directories_applying_one_source_at_once_one_is_refused(self) -> None:
        proj = os.path.join(self.tmp, "proj")
        write_tree(proj, {"k.c": "int k;\n", "one.c": "int k = 1;\n", "two.c": "int k = 2;\n"})
        source, artifact = os.path.join(proj, "k.c"), os.path.join(proj, "libk.so")
        with open(artifact, "wb") as handle:  # its backup copy keeps each run a while
            handle.write(os.urandom(32 << 20))
        before = tree_state(proj)
        release_read, release_write = os.pipe()
        ready_read, ready_write = os.pipe()
        waiting = ("import os, sys; sys.path.insert(0, %r); import overlay_setup; "
                   "os.write(%d, b'.'); os.read(%d, 1); sys.exit(overlay_setup.main(sys.argv[1:]))"
                   % (HERE, ready_write, release_read))
        env = dict(os.environ)
        env.pop("OVERLAY_STATE", None)
        runs = {}
        for name in ("one", "two"):
            state = os.path.join(self.tmp, "state-" + name)
            runs[state] = subprocess.Popen(
                [sys.executable, "-c", waiting, "--state", state, "add-native", "--source",
                 source, "--patched", os.path.join(proj, name + ".c"), "--artifact", artifact,
                 "--build-cmd", "printf x >> libk.so", "--build-cwd", proj,
                 "--owner-pid", str(os.getpid())], env=env, pass_fds=(ready_write, release_read),
                stdout=subprocess.PIPE, stderr=subprocess.PIPE, universal_newlines=True)
        os.close(ready_write)
        os.close(release_read)
        for _ in runs:  # both loaded and waiting (a read that ends at EOF if one died)
            self.assertEqual(os.read(ready_read, 1), b".")
        os.close(ready_read)
        os.close(release_write)  # both reads end at this moment
        results = {state: process.communicate(timeout=120) + (process.returncode,)
                   for state, process in runs.items()}
        won = [state for state, (_, _, rc) in results.items() if rc == 0]
        self.assertEqual(len(won), 1, results)
        winner = won[0]
        loser = [state for state in runs if state != winner][0]
        refused = ("overlay_setup: E120 --source %s is already held by the overlay at %s "
                   "(entry 1, %s); nothing was changed: revert that one first (`overlay_setup.py "
                   "--state %s revert`), or add this change to it with --state %s\n"
                   % (source, winner, source, winner, winner))
        waited = ("waiting for another overlay to journal what it claims (lock on %s)\n"
                  % os.path.dirname(overlay_setup.registry_dir()))
        self.assertIn(results[loser][1:], ((refused, 1), (waited + refused, 1)))
        self.assertEqual(read_text(source), read_text(os.path.join(proj, (
            "one.c" if winner.endswith("one") else "two.c"))))
        with open(artifact, "rb") as handle:
            handle.seek(32 << 20)
            self.assertEqual(handle.read(), b"x", "one build ran, the winner's")
        self.assertEqual(read_json(os.path.join(loser, "journal.json"))["entries"], [])
        self.assertOk(call("--state", winner, "revert"))
        self.assertEqual(tree_state(proj), before)


class ScanGrowthTest(OverlayTestCase):
    """The work of an apply and its revert grows linearly with the build
    products it backs up: counted in calls the tool's own code makes, not
    timed.  On tmpfs (where fsync costs nothing) so that it stays fast."""

    def round_trip_calls(self, products: int) -> int:
        root = tempfile.mkdtemp(prefix="overlay-scan-", dir="/dev/shm" if os.path.isdir(
            "/dev/shm") else self.tmp)
        self.addCleanup(shutil.rmtree, root, True)
        proj = os.path.join(root, "proj")
        write_tree(proj, {"k.c": "int k;\n", "../fast.c": "int k = 1;\n"})
        write_tree(proj, {"obj/d%02d/f%04d.o" % (number // 50, number): "o"
                          for number in range(products)})
        state = os.path.join(root, "state")
        counted = [0]

        def count(frame, event, arg) -> None:
            if event in ("call", "c_call") and frame.f_code.co_filename == overlay_setup.__file__:
                counted[0] += 1

        sys.setprofile(count)
        try:
            applied = call("--state", state, "add-native", "--source",
                           os.path.join(proj, "k.c"), "--patched",
                           os.path.join(root, "fast.c"), "--build-cmd", "true",
                           "--build-cwd", proj, "--owner-pid", str(os.getpid()))
            reverted = call("--state", state, "revert")
        finally:
            sys.setprofile(None)
        self.assertOk(applied)
        self.assertIn("backed up %d build product(s)" % products, applied[1])
        self.assertOk(reverted)
        return counted[0]

    def test_work_grows_linearly_with_the_backed_up_products(self) -> None:
        few, some, many = (self.round_trip_calls(n) for n in (10, 40, 310))
        first, then = (some - few) / 30, (many - some) / 270
        # Linear: each product costs the same, whatever the count.  The scan
        # that compared every entry with every product made the products
        # after the 40th cost several times as much as the 30 before them.
        self.assertLess(then, 1.25 * first, (few, some, many))


def full_tree(root: str) -> dict:
    """tree_state plus what revert must keep besides: xattrs and link counts."""
    found = {}
    for relative, facts in tree_state(root).items():
        path = os.path.join(root, relative)
        try:
            xattrs = {name: os.getxattr(path, name, follow_symlinks=False)
                      for name in os.listxattr(path, follow_symlinks=False)}
        except OSError:
            xattrs = None
        found[relative] = facts + (xattrs, os.lstat(path).st_nlink)
    return found


@unittest.skipUnless(os.environ.get("LONG_TESTS") == "1",
                     "a long run only (LONG_TESTS=1): CrashMatrixTest checks the same recovery "
                     "at every kill point")
class RandomKillTrialTest(unittest.TestCase):
    """add-native, apply, revert and gc-stale killed at random moments (fixed
    seed) while a real make builds a small C project; each round recovered
    with gc-stale and revert, then compared whole: content, mode, mtime,
    xattrs, link counts."""

    def setUp(self) -> None:
        self.tmp = tempfile.mkdtemp(prefix="overlay-trial-")
        self.addCleanup(shutil.rmtree, self.tmp, True)

    def fresh(self, number: int) -> tuple:
        base = os.path.join(self.tmp, "r%d" % number)
        root = os.path.join(base, "proj")
        write_tree(root, {name: text for name, text in KERNELS.items()
                          if not name.startswith("pkg/")})
        write_tree(base, {"fast.c": KERNELS["kernel_b.c"].replace("4.0", "7.0"),
                          "p.diff": "--- a/kernel_b.c\n+++ b/kernel_b.c\n@@ -3,3 +3,3 @@\n {\n"
                                    "-    return 4.0;\n+    return 8.0;\n }\n"})
        subprocess.run(["make", "-s", "-C", root], check=True)
        os.link(os.path.join(root, "kernels.h"), os.path.join(root, "kernels-copy.h"))
        for name in ("kernel_b.c", "libkernels.so", "kernel_b.o"):
            with contextlib.suppress(OSError):  # where the filesystem keeps user xattrs
                os.setxattr(os.path.join(root, name), "user.trial", b"kept")
        past = time.time() - 3600
        for directory, dirs, files in os.walk(root, topdown=False):
            for name in files + dirs:
                os.utime(os.path.join(directory, name), (past, past), follow_symlinks=False)
        os.utime(root, (past, past))
        return base, root, os.path.join(base, "state")

    def command(self, kind: str, base: str, root: str, state: str) -> list:
        native = ["--artifact", os.path.join(root, "libkernels.so"), "--invalidate-cache",
                  os.path.join(root, "cache"), "--build-cmd", "sleep 0.3 && make",
                  "--build-cwd", root]
        if kind == "add-native":
            return ["--state", state, "add-native", "--source", os.path.join(root, "kernel_b.c"),
                    "--patched", os.path.join(base, "fast.c")] + native
        if kind == "apply":
            return ["--state", state, "apply", os.path.join(base, "p.diff"), "--root", root] + native
        if kind == "revert":
            return ["--state", state, "revert"]
        return ["gc-stale", "--root", base]

    def start(self, args: list) -> subprocess.Popen:
        env = dict(os.environ)
        env.pop("OVERLAY_STATE", None)
        return subprocess.Popen(["sh", "-c", 'exec "$0" "$@"' + (
            " --owner-pid $$" if args[0] == "--state" and args[2] in ("add-native", "apply")
            else ""), sys.executable, TOOL] + args, env=env, stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE, universal_newlines=True)

    def test_random_kills_of_every_command_are_recovered_whole(self) -> None:
        chance = random.Random(1913)
        for number in range(16):
            kind = ("add-native", "apply", "revert", "gc-stale")[number % 4]
            base, root, state = self.fresh(number)
            expected = full_tree(root)
            if kind in ("revert", "gc-stale"):  # something applied to take back first
                setup = self.start(self.command(chance.choice(["add-native", "apply"]),
                                                base, root, state))
                if kind == "gc-stale":  # killed in its build: gc-stale has work to do
                    time.sleep(chance.uniform(0.3, 0.6))
                    setup.kill()
                self.assertIn(setup.wait(), (0, -signal.SIGKILL), setup.stderr.read())
                setup.stderr.close()
            victim = self.start(self.command(kind, base, root, state))
            delay = chance.uniform(0.0, 0.7 if kind in ("add-native", "apply") else 0.3)
            signum = chance.choice([signal.SIGKILL, signal.SIGKILL, signal.SIGTERM,
                                    signal.SIGHUP])
            time.sleep(delay)
            victim.send_signal(signum)
            status = victim.wait()
            err = victim.stderr.read()
            victim.stderr.close()
            context = "round %d: %s, %s after %.2fs, status %s: %s" % (
                number, kind, signal.Signals(signum).name, delay, status, err)
            self.assertNotIn("Traceback", err, context)
            gc = run_tool(["gc-stale", "--root", base])
            self.assertEqual(gc.returncode, 0, context + gc.stderr)
            again = run_tool(["--state", state, "revert"])
            self.assertEqual(again.returncode, 0, context + again.stderr)
            self.assertEqual(full_tree(root), expected, context)


class OverlayDocsTest(unittest.TestCase):
    """What the overlay tool's reference and usage lines show (moved here
    from test_check_contract.py, whose readers of the docs they use)."""

    def test_overlay_examples_run_as_written(self):
        test_check_contract.run_shown(self, "docs/overlay_setup.md")

    def test_the_parser_of_the_named_command_alone_reads_a_line_as_the_whole_parser(self):
        # main() builds the parser of the command a line names first (after
        # any --state DIR) and no other; it must read such a line, its usage
        # errors and --help included, as the parser of every command does.
        def read(parser: argparse.ArgumentParser, argv: list) -> tuple:
            out = io.StringIO()
            try:
                with contextlib.redirect_stdout(out):
                    return ("parsed", vars(parser.parse_args(argv)))
            except overlay_setup.CommandLineError as exc:
                return ("error", exc.message)
            except SystemExit as exc:
                return ("exit", exc.code, out.getvalue())

        lines = [["apply", "p.diff", "--build-cmd", "make", "-p", "0"],
                 ["--state", "apply", "status", "--json"], ["--state=s", "revert", "--all"],
                 ["--state", "s", "trial", "p", "--no-build", "--repeat", "x"],
                 ["init", "--owner-pid", "1", "--state", "t"], ["status", "--bogus"],
                 ["add-native", "--source", "a"], ["--state", "--state", "env"],
                 ["add-native", "--source", "a", "--patched", "b", "--no-build", "--build-cmd", "c"],
                 ["update", "--entry", "2"]] + [[name, "--help"] for name in overlay_setup.COMMANDS]
        for argv in lines:
            with self.subTest(argv=argv):
                only = overlay_setup.named_command(argv)
                self.assertIn(only, overlay_setup.COMMANDS)
                self.assertEqual(read(overlay_setup.build_parser(only), argv),
                                 read(overlay_setup.build_parser(), argv))
        for argv in (["--stat", "apply", "status"], ["--help"], ["--version"], [], ["aply"],
                     ["--state", "apply"]):
            self.assertIsNone(overlay_setup.named_command(argv), argv)

    def test_every_uncoded_failure_line_is_one_the_docs_name(self):
        docs = " ".join(read_text(os.path.join(HERE, "docs", "overlay_setup.md")).split())
        messages = docs[docs.index("## Messages and codes"):docs.index("| Code | Status |")]
        uncoded = re.findall(r'print\("(overlay_setup: [a-z][^%`"]*)', read_text(TOOL))
        self.assertEqual(len(uncoded), 6, uncoded)
        for line in uncoded:
            self.assertIn(line.strip(), messages)

    def test_build_command_or_no_build_shows_as_required(self):
        commands = test_check_contract.subcommands(overlay_setup.build_parser())
        for name in ("add-native", "apply"):
            usage = " ".join(commands[name].format_usage().split())
            self.assertIn("(--build-cmd CMD | --no-build)", usage)


TRIAL_PROJECT = dict(LIB_SOURCES, **{
    "Makefile": "libk.so: a.o b.o\n\t$(CC) -shared -o $@ a.o b.o\n"
                "%.o: %.c k.h\n\t$(CC) -O1 -fPIC -c -o $@ $<\n",
    "pkg/__init__.py": "",
    "pkg/mod.py": "VALUE = 1\n",
})


class TrialSummaryTest(unittest.TestCase):
    def test_a_command_of_a_millisecond_gets_a_ratio_that_means_something(self) -> None:
        runs = [{"kind": kind, "round": number, "exit": 0, "seconds": seconds} for number in (1, 2)
                for kind, seconds in (("reference", 0.0008), ("candidate", 0.0006))]
        summary = overlay_setup.trial_summary(runs)
        self.assertEqual((summary["reference"]["median"], summary["candidate"]["median"]), (0.0008, 0.0006))
        self.assertEqual(summary["ratio"], {"median": 0.75, "min": 0.75, "max": 0.75, "pairs": 2})


class TrialTest(OverlayTestCase):
    """trial as a kernel engineer or an optimizer reads it: the timing
    summary, the JSON, the two sides' output; and trial owning only its own
    work: the overlay's PYTHONPATH in the candidate, a refusal where something
    is applied, a clean-up that leaves another worker's overlay alone, and a
    revert that a signal does not cut short."""

    def setUp(self) -> None:
        super().setUp()
        self.proj = self.built_project(TRIAL_PROJECT)
        self.lib = os.path.join(self.proj, "libk.so")
        self.diff = os.path.join(self.tmp, "seven.diff")
        write_text_file(self.diff, "--- a/b.c\n+++ b/b.c\n@@ -2 +2 @@\n"
                                   "-int b(void) { return K; }\n+int b(void) { return 7; }\n")
        self.probe = [sys.executable, "-S", "-c", "import ctypes, sys; print(ctypes.CDLL(sys.argv[1])"
                                            ".b())", self.lib]
        self.before = tree_state(self.proj)

    def trial(self, *extra: str, command: list = None, env: dict = None,
              patch: str = None, native: bool = True) -> subprocess.CompletedProcess:
        build = ["--artifact", self.lib, "--build-cmd", "make", "--build-cwd", self.proj]
        return forked_tool(["--state", self.state, "trial", patch or self.diff, "--root",
                            self.proj] + (build if native else []) + list(extra) + ["--"]
                           + (command or self.probe), env=env)

    def test_repeat_prints_each_side_s_spread_and_the_ratio_of_the_medians(self) -> None:
        done = self.trial("--repeat", "3")
        self.assertEqual(done.returncode, 0, done.stderr)
        self.assertRegex(done.stdout, r"\n  reference: median \d+\.\d{3}s, min \d+\.\d{3}s, max "
                                      r"\d+\.\d{3}s \(3 runs\)\n  candidate: median \d+\.\d{3}s, "
                                      r"min \d+\.\d{3}s, max \d+\.\d{3}s \(3 runs\)\n"
                                      r"  candidate/reference: \d+\.\d{3} \(ratio of the medians; "
                                      r"\d+\.\d{3} to \d+\.\d{3} over the 3 paired runs\)\n"
                                      r'  output: differs \(round 1, line 1\): reference "4", '
                                      r'candidate "7"\n  verify: 1 artifact\(s\) rebuilt\n')
        self.assertIn("  watched: %s (writes elsewhere, such as an install prefix, are not "
                      "checked)\n" % self.proj, done.stdout)
        self.assertEqual(tree_state(self.proj), self.before)

    def test_each_run_is_announced_as_a_command_that_can_be_pasted(self) -> None:
        done = self.trial(command=[sys.executable, "-S", "-c", "print('a b')"])
        self.assertEqual(done.returncode, 0, done.stderr)
        self.assertIn("trial: reference run 1: %s -S -c 'print('\"'\"'a b'\"'\"')'\n"
                      % sys.executable, done.stderr)

    def test_json_holds_each_run_the_summary_the_verification_and_the_revert(self) -> None:
        done = self.trial("--repeat", "2", "--format", "json")
        self.assertEqual(done.returncode, 0, done.stderr)
        result = json.loads(done.stdout)
        self.assertEqual(sorted(result), ["command", "exit", "failed_step", "output", "patch",
                                          "revert", "runs", "state", "summary", "verify",
                                          "watched"])
        self.assertEqual((result["command"], result["exit"], result["failed_step"],
                          result["patch"], result["state"], result["verify"], result["watched"]),
                         (self.probe, 0, None, self.diff, self.state, "1 artifact(s) rebuilt",
                          [self.proj]))
        self.assertEqual([sorted(run) for run in result["runs"]],
                         [["exit", "kind", "round", "seconds"]] * 4)
        self.assertEqual([(run["kind"], run["round"], run["exit"]) for run in result["runs"]],
                         [("reference", 1, 0), ("candidate", 1, 0), ("reference", 2, 0),
                          ("candidate", 2, 0)])
        seconds = {kind: [run["seconds"] for run in result["runs"] if run["kind"] == kind]
                   for kind in ("reference", "candidate")}
        summary = result["summary"]
        self.assertEqual(sorted(summary), ["candidate", "ratio", "reference"])
        for kind, values in seconds.items():
            self.assertEqual(summary[kind], {"runs": 2, "min": min(values), "max": max(values),
                                             "median": round(sum(values) / 2, 6)})
        ratios = [c / r for r, c in zip(seconds["reference"], seconds["candidate"])]
        self.assertEqual(summary["ratio"], {
            "median": round(summary["candidate"]["median"] / summary["reference"]["median"], 3),
            "min": round(min(ratios), 3), "max": round(max(ratios), 3), "pairs": 2})
        self.assertEqual(result["output"], {"rounds": 2, "differs": True, "round": 1, "line": 1,
                                            "reference": "4", "candidate": "7"})
        self.assertEqual(result["revert"], {"reverted": True, "differences": [],
                                            "left_alone": None})

    def test_the_candidate_runs_with_the_overlay_s_pythonpath(self) -> None:
        on_python_path(self, self.proj)
        patch = os.path.join(self.tmp, "py.diff")
        write_text_file(patch, "--- a/pkg/mod.py\n+++ b/pkg/mod.py\n@@ -1 +1 @@\n"
                               "-VALUE = 1\n+VALUE = 2\n")
        done = self.trial("--no-build", patch=patch, native=False,
                          command=[sys.executable, "-c", "import pkg.mod; print(pkg.mod.VALUE)"],
                          env={"PYTHONPATH": self.proj, "PYTHONDONTWRITEBYTECODE": "1"})
        self.assertEqual(done.returncode, 0, done.stderr)
        self.assertIn('  output: differs (round 1, line 1): reference "1", candidate "2"\n',
                      done.stdout)
        self.assertEqual(tree_state(self.proj), self.before)

    def test_a_candidate_that_never_loads_the_python_overlay_fails_saying_so(self) -> None:
        on_python_path(self, self.proj)
        patch = os.path.join(self.tmp, "py.diff")
        write_text_file(patch, "--- a/pkg/mod.py\n+++ b/pkg/mod.py\n@@ -1 +1 @@\n"
                               "-VALUE = 1\n+VALUE = 2\n")
        for flag in ("-I", "-E", "-S"):
            with self.subTest(flag=flag):
                done = self.trial("--no-build", patch=patch, native=False, command=[
                    sys.executable, flag, "-B", "-c", "import sys; sys.path.insert(0, %r); "
                    "import pkg.mod; print(pkg.mod.VALUE)" % self.proj],
                    env={"PYTHONPATH": self.proj, "PYTHONDONTWRITEBYTECODE": "1"})
                self.assertEqual(done.returncode, 13, done.stderr)
                self.assertIn("result: candidate: no process of the candidate run loaded the "
                              "Python overlay (python -I, -E or -S ignores its PYTHONPATH or "
                              "sitecustomize), so the patched module was not in effect (exit "
                              "status 13)\n", done.stdout)
                self.assertEqual(tree_state(self.proj), self.before)

    def test_a_piped_patch_is_read_once_for_every_round(self) -> None:
        # trial <(git diff) --repeat 3: the shell's pipe can be read once.
        read_end, write_end = os.pipe()
        with open(self.diff, "rb") as handle:
            os.write(write_end, handle.read())
        os.close(write_end)
        self.addCleanup(os.close, read_end)
        done = self.trial("--repeat", "3", patch="/dev/fd/%d" % read_end)
        self.assertEqual(done.returncode, 0, done.stderr)
        self.assertIn("(3 runs)", done.stdout)
        self.assertEqual(tree_state(self.proj), self.before)

    def test_a_state_with_something_applied_is_refused_naming_it(self) -> None:
        fast = os.path.join(self.tmp, "fast.c")
        write_text_file(fast, "int a(void) { return 2; }\n")
        self.assertOk(self.tool("add-native", "--source", os.path.join(self.proj, "a.c"),
                                "--patched", fast, "--no-build"))
        owner = overlay_setup.describe_owner(read_json(os.path.join(self.state,
                                                                    "journal.json"))["owner"])
        done = self.trial()
        self.assertEqual((done.returncode, done.stdout), (1, ""))
        self.assertEqual(done.stderr, "overlay_setup: E103 a trial needs a state directory with "
                         "nothing applied, and %s holds entry 1 (%s/a.c), owner %s; run "
                         "`overlay_setup.py --state %s revert`, or pass another --state\n"
                         % (self.state, self.proj, owner, self.state))

    def test_the_clean_up_leaves_another_worker_s_overlay_alone(self) -> None:
        # Two workers share one state directory: the other one applies while
        # this trial's reference run goes on, so this trial's apply fails.
        fast = os.path.join(self.tmp, "fast.c")
        write_text_file(fast, "int a(void) { return 2; }\n")
        other = subprocess.Popen(["sleep", "600"])
        self.addCleanup(other.wait)
        self.addCleanup(other.kill)
        worker = " ".join(shell_words([sys.executable, TOOL, "--state", self.state, "add-native",
                                       "--source", os.path.join(self.proj, "a.c"), "--patched",
                                       fast, "--no-build", "--owner-pid", str(other.pid)]))
        done = self.trial(command=["sh", "-c", "[ -e %s ] || %s >/dev/null; echo ran"
                                   % (self.state, worker)])
        self.assertEqual(done.returncode, 11, done.stderr)
        self.assertIn("overlay_setup: E205 ", done.stderr)
        self.assertIn("  revert: nothing of the trial's to revert: the overlay at %s is another's"
                      % self.state, done.stdout)
        self.assertIn("entry 1: applied, without a build", self.tool("status")[1])
        self.assertOk(self.tool("revert"))
        self.assertEqual(tree_state(self.proj), self.before)

    def first_revert_point(self) -> int:
        """The trial's first mutation in its revert, found by bisection: a
        SIGTERM at an earlier point interrupts the apply or a run, one at a
        later point finds the revert running, or comes after the end."""
        low, high = 1, 128
        while low < high:
            middle = (low + high) // 2
            done = self.trial(env={"OVERLAY_TEST_KILL_AT": str(middle),
                                   "OVERLAY_TEST_KILL_SIGNAL": "TERM"})
            if "during the revert" in done.stderr or done.returncode == 0:
                high = middle
            else:
                low = middle + 1
        self.assertEqual(tree_state(self.proj), self.before)
        return low

    def test_a_signal_during_the_revert_lets_it_finish_and_a_second_one_says_how_to_finish(
            self) -> None:
        first = self.first_revert_point()
        done = self.trial(env={"OVERLAY_TEST_KILL_AT": str(first),
                               "OVERLAY_TEST_KILL_SIGNAL": "TERM"})
        self.assertEqual(done.returncode, 143, done.stderr)
        self.assertIn("trial: SIGTERM during the revert; finishing the revert first (a second "
                      "signal stops it and leaves the install patched)\n", done.stderr)
        self.assertIn("  revert: the install is byte-identical to before\nresult: interrupted "
                      "by SIGTERM (exit status 143)\n", done.stdout)
        self.assertEqual(tree_state(self.proj), self.before)
        done = self.trial(env={"OVERLAY_TEST_KILL_AT": "%d,%d" % (first, first + 1),
                               "OVERLAY_TEST_KILL_SIGNAL": "TERM"})
        self.assertEqual(done.returncode, 14, done.stderr)
        self.assertIn("overlay_setup: the trial's revert was stopped by a second SIGTERM; the "
                      "install is still patched: run `overlay_setup.py --state %s revert` to "
                      "finish it\n" % self.state, done.stderr)
        self.assertTrue(done.stdout.endswith("result: revert: the revert did not finish (see "
                                             "above) (exit status 14)\n"), done.stdout)
        self.assertNotEqual(tree_state(self.proj), self.before)
        self.assertOk(self.tool("revert"))
        self.assertEqual(tree_state(self.proj), self.before)

    def test_a_stopped_trial_whose_install_differs_does_not_exit_as_reverted(self) -> None:
        # The candidate writes into the install, then the trial gets SIGTERM:
        # the revert runs, but the install is not as it was: 14, not 143.
        # (only the candidate runs with the overlay's environment, OVERLAY_STATE)
        done = self.trial(command=["sh", "-c", '[ -z "$OVERLAY_STATE" ] || { touch "$0/notes"; '
                                               'kill -TERM $PPID; }', self.proj])
        self.assertEqual(done.returncode, 14, done.stderr)
        self.assertIn("  revert: the install differs from before: %s/notes\nresult: revert: "
                      "the install is not as it was before (exit status 14)\n" % self.proj,
                      done.stdout)

    @unittest.skipUnless(shm_available(), "needs /dev/shm on another filesystem than the temp dir")
    def test_on_tmpfs_a_file_written_into_the_install_is_the_one_difference(self) -> None:
        # tmpfs (as btrfs and xfs) gives a directory the size of its entries:
        # the folder the candidate wrote into differs by size alone.
        shm = tempfile.mkdtemp(prefix="overlay-test-", dir="/dev/shm")
        self.addCleanup(shutil.rmtree, shm, True)
        self.proj = self.built_copy(os.path.join(shm, "proj"), TRIAL_PROJECT, ["make"], aged=True)
        self.lib = os.path.join(self.proj, "libk.so")
        self.probe[-1] = self.lib
        self.test_a_stopped_trial_whose_install_differs_does_not_exit_as_reverted()

    def test_no_line_inside_a_trial_says_to_run_revert(self) -> None:
        done = self.trial()
        self.assertEqual(done.returncode, 0, done.stderr)
        self.assertNotIn("revert`", done.stderr + done.stdout)
        broken = os.path.join(self.tmp, "broken.diff")
        write_text_file(broken, "--- a/b.c\n+++ b/b.c\n@@ -2 +2 @@\n"
                                "-int b(void) { return K; }\n+int b(void) { return }\n")
        done = self.trial(patch=broken)
        self.assertEqual(done.returncode, 11, done.stderr)
        self.assertRegex(done.stderr, r"\noverlay_setup: E401 the build command exited with "
                                      r"status 2 after \d+\.\ds\n")
        self.assertNotIn("revert`", done.stderr + done.stdout)
        self.assertEqual(tree_state(self.proj), self.before)

    def test_entry_numbers_start_again_once_everything_is_reverted(self) -> None:
        fast = os.path.join(self.tmp, "fast.c")
        write_text_file(fast, "int a(void) { return 2; }\n")
        args = ("add-native", "--source", os.path.join(self.proj, "a.c"), "--patched", fast,
                "--no-build")
        for _ in range(2):
            rc, out, err = self.tool(*args)
            self.assertEqual((rc, err), (0, ""))
            self.assertIn("entry 1 applied without a build", out)
            self.assertOk(self.tool("revert"))


def shell_words(words: list) -> list:
    return [overlay_setup.shell_quote(word) for word in words]


class ApplyMessageTest(OverlayTestCase):
    """What a new user meets first: a mistyped command, a patch applied
    twice, a patch of .py files only, a patch that tunes the build file."""

    def setUp(self) -> None:
        super().setUp()
        self.proj = self.built_project(TRIAL_PROJECT)
        self.before = tree_state(self.proj)
        on_python_path(self, self.proj)

    def diff(self, relative: str, old: str, new: str) -> str:
        path = os.path.join(self.tmp, "change.diff")
        write_text_file(path, "".join(difflib.unified_diff(
            old.splitlines(True), new.splitlines(True), "a/" + relative, "b/" + relative)))
        return path

    def test_a_mistyped_command_gets_a_did_you_mean(self) -> None:
        rc, out, err = call("aply", "x.diff")
        self.assertEqual((rc, out), (2, ""))
        self.assertRegex(err, r"^overlay_setup: E100 argument COMMAND: invalid choice: 'aply' "
                              r"\(choose from .*\); did you mean \"apply\"\?; see "
                              r"overlay_setup.py --help\n$")
        self.assertNotIn("did you mean", call("xyzzy")[2])

    def test_a_patch_applied_twice_names_its_entry_and_update(self) -> None:
        patch = self.diff("b.c", LIB_SOURCES["b.c"], LIB_SOURCES["b.c"].replace("K", "7"))
        self.assertOk(self.tool("apply", patch, "--root", self.proj, "--no-build"))
        self.assertEqual(self.tool("apply", patch, "--root", self.proj, "--no-build"), (
            1, "", "overlay_setup: E103 change.diff is already applied as entry 1 (%s/b.c); "
            "nothing was written: to change that entry, run `overlay_setup.py --state %s update "
            "PATCH` with a patch against the original, or `overlay_setup.py --state %s revert` "
            "first\n" % (self.proj, self.state, self.state)))
        self.assertOk(self.tool("revert"))
        self.assertEqual(tree_state(self.proj), self.before)

    def test_a_patch_of_py_files_only_needs_no_build_option(self) -> None:
        patch = self.diff("pkg/mod.py", "VALUE = 1\n", "VALUE = 2\n")
        rc, out, err = self.tool("apply", patch, "--root", self.proj)
        self.assertEqual((rc, err), (0, ""))
        self.assertIn("1 Python module(s) overlaid (pkg.mod)", out)
        self.assertOk(self.tool("revert"))
        self.assertEqual(tree_state(self.proj), self.before)

    def test_a_patch_of_py_files_says_how_to_run_with_the_overlay(self) -> None:
        patch = self.diff("pkg/mod.py", "VALUE = 1\n", "VALUE = 2\n")
        rc, out, err = self.tool("apply", patch, "--root", self.proj)
        self.assertEqual((rc, err), (0, ""))
        self.assertEqual(out.splitlines()[-1], "applied change.diff: 1 Python module(s) overlaid "
                         "(pkg.mod), seen by processes started after `eval \"$(overlay_setup.py "
                         "--state %s env)\"`; run `overlay_setup.py --state %s revert` to take it "
                         "back" % (self.state, self.state))
        self.assertOk(self.tool("revert"))

    def test_a_build_file_is_patched_in_place_and_reverted_like_a_source(self) -> None:
        makefile = TRIAL_PROJECT["Makefile"]
        patch = self.diff("Makefile", makefile, makefile.replace("-O1", "-O2"))
        # make rebuilds for a changed Makefile only when asked: -B
        rc, out, err = self.tool("apply", patch, "--root", self.proj, "--artifact",
                                 os.path.join(self.proj, "b.o"), "--build-cmd", "make -B",
                                 "--build-cwd", self.proj)
        self.assertEqual((rc, err), (0, ""))
        self.assertIn("-O2 -fPIC -c -o b.o b.c", out)
        self.assertIn("-O2", read_text(os.path.join(self.proj, "Makefile")))
        self.assertOk(self.tool("revert"))
        self.assertEqual(tree_state(self.proj), self.before)
        self.assertEqual(quiet(["make", "-q"], self.proj).returncode, 0)

    def test_stderr_lines_take_the_three_forms_the_docs_name(self) -> None:
        patch = self.diff("b.c", LIB_SOURCES["b.c"], LIB_SOURCES["b.c"].replace("K", "7"))
        rc, out, warned = self.tool("apply", patch, "--root", self.proj, "--build-cmd", "make",
                                    "--build-cwd", self.proj)
        self.assertEqual((rc, warned), (0, "warning: no --artifact given; verify-native will "
                                           "have nothing to check\n"))
        self.assertOk(self.tool("revert"))
        shared = os.path.join(self.tmp, "shared")
        self.assertOk(call("--state", shared, "init"))
        os.chmod(shared, 0o777)
        rc, out, counted = call("gc-stale", "--root", self.tmp)
        self.assertEqual(rc, 1)
        self.assertTrue(counted.endswith("\noverlay_setup: 1 state directory refused or failed; "
                                         "see above\n"), counted)
        for line in (warned + counted).splitlines():
            self.assertRegex(line, r"^(overlay_setup: E\d{3} |warning: |overlay_setup: \d+ "
                                   r"state director(y|ies) (refused or failed|not reverted); "
                                   r"see above$)")
        docs = " ".join(read_text(os.path.join(HERE, "docs", "overlay_setup.md")).split())
        for line in (warned.strip(), counted.splitlines()[-1]):
            self.assertIn("`%s`" % line, docs)

    def test_build_ninja_stays_refused(self) -> None:
        write_text_file(os.path.join(self.proj, "build.ninja"), "# generated\n")
        patch = self.diff("build.ninja", "# generated\n", "# edited\n")
        self.assertEqual(self.tool("apply", patch, "--root", self.proj, "--no-build"), (
            1, "", "overlay_setup: E303 change.diff: build.ninja is written by the build system "
            "(CMake, Meson, torch's extension loader); nothing was written: patch what generates "
            "it instead\n"))


# A real PyTorch, for TorchExtensionTest: the interpreter of a virtual
# environment with torch, ninja and setuptools installed.
TORCH_PYTHON_VARIABLE = "OVERLAY_TEST_TORCH_PYTHON"

# The op of the extensions: Python's C API only, so that each compile takes a
# second, not the half minute <torch/extension.h> takes; torch's loader,
# BuildExtension, ninja and nvcc build it as they build any extension.
TORCH_OP = """#include <Python.h>
#define JOIN2(a, b) a##b
#define JOIN(a, b) JOIN2(a, b)
#define TEXT2(a) #a
#define TEXT(a) TEXT2(a)
static PyObject *scale(PyObject *self, PyObject *x)
{
    return PyFloat_FromDouble(PyFloat_AsDouble(x) * 4.0);
}
static PyMethodDef methods[] = {{"scale", scale, METH_O, ""}, {NULL, NULL, 0, NULL}};
static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, TEXT(TORCH_EXTENSION_NAME), "", -1,
                                    methods};
PyMODINIT_FUNC JOIN(PyInit_, TORCH_EXTENSION_NAME)(void) { return PyModule_Create(&module); }
"""

TORCH_KERNEL = """__global__ void scale(float *x) { x[threadIdx.x] *= 4.0f; }
"""

TORCH_LABEL = "def label():\n    return 'plain'\n"


# The tool as its own owner: gone once it is killed.
OWN = ["sh", "-c", 'exec "$@" --owner-pid $$', "sh"]


def jit_package(name: str, cache_inside: bool) -> dict:
    """A package whose import compiles its op with torch.utils.cpp_extension.load,
    into torch's own cache (TORCH_EXTENSIONS_DIR) or a folder inside it."""
    cache = 'os.path.join(_here, "_jit")' if cache_inside else "None"
    return {
        "%s/__init__.py" % name: (
            "import os\n"
            "from torch.utils.cpp_extension import load\n"
            "from .label import label\n"
            "_here = os.path.dirname(os.path.abspath(__file__))\n"
            "_cache = %s\n"
            "if _cache:\n"
            "    os.makedirs(_cache, exist_ok=True)\n"
            "_op = load(%r, [os.path.join(_here, 'csrc', 'op.cpp')], build_directory=_cache)\n"
            "scale = _op.scale\n" % (cache, name + "_op")),
        "%s/csrc/op.cpp" % name: TORCH_OP,
        "%s/label.py" % name: TORCH_LABEL,
    }


def aot_package(cuda: bool) -> dict:
    """A setup.py project built by torch's BuildExtension: a CppExtension, and
    a CUDAExtension when nvcc is there."""
    extensions = ['CppExtension("aot._op", ["aot/op.cpp"])']
    if cuda:
        extensions.append('CUDAExtension("aot._kern", ["aot/kern.cu"])')
    return {
        "aot/__init__.py": "from . import _op\nfrom .label import label\nscale = _op.scale\n",
        "aot/op.cpp": TORCH_OP.replace("TORCH_EXTENSION_NAME", "_op"),
        "aot/label.py": TORCH_LABEL,
        "aot/kern.cu": TORCH_KERNEL,
        "setup.py": (
            "from setuptools import setup\n"
            "from torch.utils.cpp_extension import BuildExtension, CppExtension, CUDAExtension\n"
            'setup(name="aot", version="0", packages=["aot"],\n'
            "      ext_modules=[%s],\n"
            '      cmdclass={"build_ext": BuildExtension})\n' % ", ".join(extensions)),
    }


def descendants(pid: int) -> list:
    """[(pid, command)] of the live processes below `pid`."""
    parents, commands = {}, {}
    for name in os.listdir("/proc"):
        try:
            with open("/proc/%s/stat" % name, encoding="ascii", errors="replace") as handle:
                text = handle.read()
        except OSError:
            continue
        fields = text[text.rfind(")") + 2:].split()
        if name.isdigit() and fields[0] != "Z":
            parents[int(name)] = int(fields[1])
            commands[int(name)] = text[text.find("(") + 1:text.rfind(")")]
    found, frontier = [], {pid}
    while frontier:
        frontier = {child for child, parent in parents.items() if parent in frontier}
        found += [(child, commands[child]) for child in sorted(frontier)]
    return found


def process_state(pid: int) -> str:
    try:
        with open("/proc/%d/stat" % pid, encoding="ascii", errors="replace") as handle:
            text = handle.read()
    except OSError:
        return "gone"
    return text[text.rfind(")") + 2:].split()[0]


class FirstUseMessageTest(OverlayTestCase):
    """The commands a message tells a new user to run work as written from
    where they are, and every failure line carries its code."""

    def setUp(self) -> None:
        super().setUp()
        self.proj = os.path.join(self.tmp, "proj")
        write_tree(self.proj, TRIAL_PROJECT)
        quiet(["make"], self.proj).check_returncode()
        self.patched = os.path.join(self.tmp, "b_fast.c")
        write_text_file(self.patched, LIB_SOURCES["b.c"].replace("K;", "7;"))
        self.add = ["add-native", "--source", os.path.join(self.proj, "b.c"), "--patched",
                    self.patched, "--artifact", os.path.join(self.proj, "libk.so")]

    def test_the_dry_run_of_a_later_build_names_the_state_for_verify_native(self) -> None:
        rc, out, err = self.tool(*self.add, "--no-build", "--dry-run")
        self.assertEqual((rc, err), (0, ""))
        self.assertIn("  build      none (--no-build: a later build, such as a JIT at import, "
                      "rebuilds; then `overlay_setup.py --state %s verify-native`)\n"
                      % self.state, out)

    def test_verify_native_and_update_after_a_revert_say_nothing_is_applied(self) -> None:
        self.assertOk(self.tool(*self.add, "--build-cmd", "make", "--build-cwd", self.proj))
        self.assertOk(self.tool("revert"))
        nothing = "overlay_setup: E207 nothing is applied at %s; `apply` or `add-native` first\n"
        self.assertEqual(self.tool("verify-native"), (1, "", nothing % self.state))
        self.assertEqual(self.tool("update"), (1, "", nothing % self.state))

    def test_the_help_of_state_gives_the_default_the_tool_uses(self) -> None:
        rc, out, err = call("status", "--help")
        self.assertEqual((rc, err), (0, ""))
        self.assertIn("state directory (default: $OVERLAY_STATE, else the current directory's "
                      "own under $XDG_STATE_HOME/overlay_setup/)", " ".join(out.split()))

    def test_a_trial_does_not_send_the_user_to_status_for_what_it_reverts(self) -> None:
        objects = ["f%d.o" % number for number in range(1, 7)]
        write_tree(self.tmp, dict(
            {"many/k.h": "#define K 4\n", "many/Makefile": (
                "libk.so: %s\n\t$(CC) -shared -o $@ $^\n%%.o: %%.c k.h\n"
                "\t$(CC) -fPIC -c -o $@ $<\n" % " ".join(objects))},
            **{"many/" + name[:-2] + ".c": '#include "k.h"\nint %s(void) { return K; }\n'
               % name[:-2] for name in objects}))
        many = os.path.join(self.tmp, "many")
        quiet(["make"], many).check_returncode()
        patch = os.path.join(self.tmp, "k.diff")
        write_text_file(patch, "--- a/k.h\n+++ b/k.h\n@@ -1 +1 @@\n-#define K 4\n+#define K 5\n")
        done = run_tool(["--state", self.state, "trial", patch, "--root", many, "--artifact",
                         os.path.join(many, "libk.so"), "--build-cmd", "make", "--build-cwd",
                         many, "--", "true"])
        self.assertEqual(done.returncode, 0, done.stderr)
        self.assertIn("backed up 6 build product(s) the build may rewrite: %s, and 2 more\n"
                      % ", ".join("many/%s (predicted by make -n -W)" % name
                                  for name in objects[:4]), done.stderr)

    def test_a_patch_another_overlay_applied_is_named_as_its_not_a_hunk_mismatch(self) -> None:
        patch = os.path.join(self.tmp, "b.diff")
        write_text_file(patch, unified_diff("b.c", LIB_SOURCES["b.c"], read_text(self.patched)))
        self.assertOk(self.tool("apply", patch, "--root", self.proj, "--no-build"))
        other = os.path.join(self.tmp, "other-state")
        source = os.path.join(self.proj, "b.c")
        self.assertEqual(call("--state", other, "apply", patch, "--root", self.proj, "--no-build"),
                         (1, "", "overlay_setup: E120 --source %s is already held by the overlay "
                                 "at %s (entry 1, %s); nothing was changed: revert that one first "
                                 "(`overlay_setup.py --state %s revert`), or add this change to "
                                 "it with --state %s\n"
                                 % (source, self.state, source, self.state, self.state)))

    def test_a_trial_of_a_command_that_does_not_exist_is_refused_before_anything(self) -> None:
        patch = os.path.join(self.tmp, "b.diff")
        write_text_file(patch, unified_diff("b.c", LIB_SOURCES["b.c"], read_text(self.patched)))
        before = tree_state(self.proj)
        self.assertEqual(call("--state", self.state, "trial", patch, "--root", self.proj,
                              "--no-build", "--", "no-such-benchmark", "--fast"),
                         (2, "", "overlay_setup: E102 cannot run no-such-benchmark: no such "
                                 "command on PATH, or not an executable file; pass the command "
                                 "to measure as it runs from here\n"))
        self.assertEqual(tree_state(self.proj), before)
        self.assertFalse(os.path.exists(self.state))

    def test_verify_native_of_an_entry_without_an_artifact_asks_for_one(self) -> None:
        rc, out, err = self.tool(*self.add[:5], "--no-build")
        self.assertEqual((rc, err), (0, ""))
        self.assertEqual(self.tool("verify-native"), (
            1, "", "overlay_setup: E405 no built artifact to verify; pass --artifact to add-native "
            "or apply\n"))

    def test_verify_native_after_a_jit_build_into_the_cache_names_what_it_built(self) -> None:
        # A JIT at import (torch's load()) builds into the --invalidate-cache
        # folder, under a name the user need not know beforehand.
        cache = os.path.join(self.tmp, "jit-cache")
        write_tree(cache, {"k/old.so": "old build\n"})
        rc, out, err = self.tool(*self.add[:5], "--invalidate-cache", cache, "--no-build")
        self.assertEqual((rc, err), (0, ""))
        self.assertEqual(self.tool("verify-native"), (
            1, "", "overlay_setup: E403 nothing was built into --invalidate-cache %s since the "
            "apply: the build that fills it (a JIT at import) has not run yet, or did not see "
            "the patch\n" % cache))
        os.makedirs(os.path.join(cache, "k"))
        quiet(["cc", "-shared", "-fPIC", "-I", self.proj, "-o", os.path.join(cache, "k", "k.so"),
               self.patched], self.tmp).check_returncode()
        self.assertEqual(self.tool("verify-native"), (
            0, "1 artifact(s) rebuilt from the patched sources: %s (built into --invalidate-cache "
            "%s since the apply)\n" % (os.path.join(cache, "k", "k.so"), cache), ""))
        self.assertOk(self.tool("revert"))
        self.assertEqual(read_text(os.path.join(cache, "k", "old.so")), "old build\n")

    def test_gc_stale_gives_the_code_of_a_state_whose_journal_is_gone(self) -> None:
        self.assertOk(self.tool(*self.add, "--no-build"))
        shutil.rmtree(self.state)
        rc, out, err = call("gc-stale", "--root", self.proj)
        self.assertEqual((rc, out, err), (1, "", (
            "overlay_setup: E209 state directory %s is registered with an overlay applied, but "
            "its journal is gone (deleted by a build's clean step, or by hand): the install may "
            "still be patched and its backups are lost; restore the patched files from version "
            "control or a reinstall, then delete %s\n"
            "overlay_setup: 1 state directory refused or failed; see above\n"
            % (self.state, overlay_setup.registry_record(self.state)))))


def unified_diff(path: str, old: str, new: str) -> str:
    return "".join(difflib.unified_diff(old.splitlines(True), new.splitlines(True),
                                        "a/" + path, "b/" + path))


def cuda_home() -> str:
    """The toolkit the `nvcc` on PATH belongs to, also when that is a wrapper
    script (`exec /usr/local/cuda-13.0/bin/nvcc "$@"`): nvcc names its own
    directory in a dry run."""
    done = quiet(["nvcc", "--dryrun", "-c", "-x", "cu", os.devnull, "-o", os.devnull], "/")
    found = re.search(r"^#\$ _HERE_=(.*)$", done.stdout, re.M)
    return os.path.dirname(found.group(1)) if found else ""


class TorchExtensionTest(OverlayTestCase):
    """The tool on real PyTorch extensions: torch.utils.cpp_extension.load's
    JIT (its cache outside the package and inside it), setup.py with
    BuildExtension built in place, and an editable pip install; a
    CUDAExtension compiled by nvcc when there is one (no GPU: judged by the
    device code in its object).  Runs when $OVERLAY_TEST_TORCH_PYTHON names an
    interpreter that imports torch."""

    maxDiff = None

    @classmethod
    def setUpClass(cls) -> None:
        python = os.environ.get(TORCH_PYTHON_VARIABLE)
        if not python:
            raise unittest.SkipTest("%s is not set: set it to a python that imports torch "
                                    "(pip install torch ninja setuptools)" % TORCH_PYTHON_VARIABLE)
        try:
            done = quiet([python, "-c", "import torch, setuptools"], "/")
        except OSError as exc:
            raise unittest.SkipTest("%s=%s cannot run: %s" % (TORCH_PYTHON_VARIABLE, python,
                                                              exc.strerror))
        if done.returncode:
            raise unittest.SkipTest("%s=%s cannot import torch and setuptools: %s" % (
                TORCH_PYTHON_VARIABLE, python, (done.stdout.strip().splitlines() or ["?"])[-1]))
        cls.python = python
        cls.bin = os.path.dirname(python)  # its ninja first on PATH, for torch and the tool
        cls.cuda_home = cuda_home() if shutil.which("nvcc") else ""

    def setUp(self) -> None:
        super().setUp()
        self.site = os.path.join(self.tmp, "site")
        self.ext = os.path.join(self.tmp, "ext")
        environment = {"PATH": self.bin + os.pathsep + os.environ["PATH"],
                       "TORCH_EXTENSIONS_DIR": self.ext, "PYTHONDONTWRITEBYTECODE": "1",
                       "CUDA_HOME": self.cuda_home, "TORCH_CUDA_ARCH_LIST": "8.0+PTX",
                       "MAX_JOBS": "2"}
        for name, value in environment.items():
            self.addCleanup(os.environ.__setitem__, name, os.environ[name]) \
                if name in os.environ else self.addCleanup(os.environ.pop, name, None)
            os.environ[name] = value
        on_python_path(self, self.site)

    def package(self, files: dict, where: str = None) -> str:
        root = where or self.site
        write_tree(root, files)
        return root

    def probe(self, name: str, python: str = None, env: dict = None) -> str:
        """What the op and the Python half of package `name` give, in a fresh process."""
        done = subprocess.run([python or self.python, "-c", "import %s as p; print(p.scale(1.0), "
                               "p.label())" % name], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, universal_newlines=True, timeout=300,
                              env=dict(os.environ, **(env or {})))
        self.assertEqual(done.returncode, 0, done.stderr)
        return done.stdout.strip()

    def snapshot(self, *roots: str) -> list:
        return [tree_state(root) if os.path.isdir(root) else None for root in roots]

    def patch(self, name: str, relative: str, old: str, new: str, more: tuple = ()) -> str:
        text = unified_diff(relative, old, new) + "".join(unified_diff(*part) for part in more)
        path = os.path.join(self.tmp, name)
        write_text_file(path, text)
        return path

    def op_patch(self, package: str, factor: str = "7.0", label: bool = False,
                 op: str = None) -> str:
        original = TORCH_OP if op is None else aot_package(False)[op]  # as installed
        op = op or "%s/csrc/op.cpp" % package
        more = (("%s/label.py" % package, TORCH_LABEL, TORCH_LABEL.replace("plain", "patched")),
                ) if label else ()
        return self.patch("op-%s.diff" % factor, op, original,
                          original.replace("* 4.0", "* %s" % factor), more)

    def ninja_has_no_work(self, directory: str) -> None:
        self.assertIn("ninja: no work to do.", quiet(["ninja", "-n"], directory).stdout)

    def kill_when_compiling(self, argv: list, compiler: str) -> None:
        """Start `argv` in a process group of its own and SIGKILL that group
        once `compiler` (cc1plus, cicc) runs below it; then wait until the
        processes it started are gone (ninja runs each job in a group of its
        own, which outlives it: a build the tool started is stopped by
        gc-stale, a compile of a killed import ends by itself)."""
        process = subprocess.Popen(argv, start_new_session=True, stdout=subprocess.DEVNULL,
                                   stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 120
        below: list = []
        while time.monotonic() < deadline and process.poll() is None and not any(
                command == compiler for _, command in below):
            time.sleep(0.01)
            below = descendants(process.pid)
        os.killpg(process.pid, signal.SIGKILL)
        self.assertEqual(process.wait(), -signal.SIGKILL, "it finished before %s ran" % compiler)
        self.started = [pid for pid, _ in below]

    def wait_for_started(self) -> None:
        deadline = time.monotonic() + 120
        while any(os.path.exists("/proc/%d" % pid) and process_state(pid) != "Z"
                  for pid in self.started) and time.monotonic() < deadline:
            time.sleep(0.01)

    def test_jit_cache_outside_the_package_no_build_then_the_import_builds(self) -> None:
        self.package(jit_package("jitout", cache_inside=False))
        self.assertEqual(self.probe("jitout"), "4.0 plain")  # the first import compiles
        cache = os.path.join(self.ext, "jitout_op")
        before = self.snapshot(self.site, self.ext)
        args = ["apply", self.op_patch("jitout"), "--root", self.site, "--python", self.python,
                "--artifact", os.path.join(cache, "jitout_op.so"), "--no-build"]
        self.assertOk(self.tool(*args))
        self.assertEqual(self.tool("verify-native")[0], 1)  # the import has not built yet
        self.assertEqual(self.probe("jitout"), "7.0 plain")
        self.assertEqual(self.tool("verify-native"),
                         (0, "1 artifact(s) rebuilt from the patched sources\n", ""))
        rc, out, err = self.tool("revert")
        self.assertEqual((rc, err), (0, ""))
        self.assertEqual(self.snapshot(self.site, self.ext), before)
        self.ninja_has_no_work(cache)
        self.assertEqual(self.probe("jitout"), "4.0 plain")
        self.assertEqual(self.snapshot(self.site, self.ext), before)  # it compiled nothing

    def test_trial_building_in_the_jit_cache_inside_the_package_with_a_py_half(self) -> None:
        self.package(jit_package("jitin", cache_inside=True))
        self.assertEqual(self.probe("jitin"), "4.0 plain")
        cache = os.path.join(self.site, "jitin", "_jit")
        before = self.snapshot(self.site, self.ext)
        done = run_tool(["--state", self.state, "trial", self.op_patch("jitin", label=True),
                         "--root", self.site, "--python", self.python,
                         "--artifact", os.path.join(cache, "jitin_op.so"),
                         "--build-cmd", "python -c 'import jitin'", "--build-cwd", cache,
                         "--", self.python, "-c", "import jitin as p; print(p.scale(1.0), "
                                                  "p.label())"])
        self.assertEqual(done.returncode, 0, done.stdout + done.stderr)
        self.assertIn('  output: differs (round 1, line 1): reference "4.0 plain", candidate '
                      '"7.0 patched"\n  verify: 1 artifact(s) rebuilt\n  revert: the install '
                      'is byte-identical to before\nresult: ok (exit status 0)\n', done.stdout)
        self.assertIn("back up    %s/.ninja_log (build product, predicted from ninja's graph)"
                      % cache, self.tool("apply", self.op_patch("jitin"), "--root", self.site,
                                         "--artifact", os.path.join(cache, "jitin_op.so"),
                                         "--build-cmd", "python -c 'import jitin'",
                                         "--build-cwd", cache, "--dry-run")[1])
        self.assertEqual(self.snapshot(self.site, self.ext), before)
        self.ninja_has_no_work(cache)

    def test_trial_no_build_verifies_after_the_candidate_run(self) -> None:
        self.package(jit_package("jitout", cache_inside=False))
        self.assertEqual(self.probe("jitout"), "4.0 plain")
        before = self.snapshot(self.site, self.ext)
        done = run_tool(["--state", self.state, "trial", self.op_patch("jitout"), "--root",
                         self.site, "--artifact",
                         os.path.join(self.ext, "jitout_op", "jitout_op.so"), "--no-build",
                         "--format", "json", "--", self.python, "-c",
                         "import jitout; print(jitout.scale(1.0))"])
        self.assertEqual(done.returncode, 0, done.stdout + done.stderr)
        result = json.loads(done.stdout)
        self.assertEqual((result["verify"], result["output"]["reference"],
                          result["output"]["candidate"], result["revert"]["differences"]),
                         ("1 artifact(s) rebuilt (checked after the candidate run: with "
                          "--no-build the build runs in it)", "4.0", "7.0", []))
        self.assertEqual(result["watched"], [os.path.join(self.ext, "jitout_op"), self.site])
        self.assertEqual(self.snapshot(self.site, self.ext), before)

    def test_jit_build_directory_set_aside_verifies_the_op_against_its_copy(self) -> None:
        self.package(jit_package("jitout", cache_inside=False))
        self.assertEqual(self.probe("jitout"), "4.0 plain")
        cache = os.path.join(self.ext, "jitout_op")
        library = os.path.join(cache, "jitout_op.so")
        before = self.snapshot(self.site, self.ext)
        args = ["apply", self.op_patch("jitout"), "--root", self.site, "--python", self.python,
                "--invalidate-cache", cache, "--artifact", library,
                "--build-cmd", "python -c 'import jitout'", "--build-cwd", self.site]
        rc, out, err = self.tool(*args, "--dry-run")
        self.assertEqual((rc, err), (0, ""))
        self.assertIn("  compare    %s (artifact in the cache %s: compared with its set-aside "
                      "copy)\n" % (library, cache), out)
        self.assertOk(self.tool(*args))
        self.assertEqual(self.tool("verify-native"),
                         (0, "1 artifact(s) rebuilt from the patched sources\n", ""))
        self.assertEqual(self.probe("jitout"), "7.0 plain")
        rc, out, err = self.tool("revert")
        self.assertEqual((rc, err), (0, ""))
        self.assertEqual(self.snapshot(self.site, self.ext), before)
        self.ninja_has_no_work(cache)
        self.assertEqual(self.probe("jitout"), "4.0 plain")
        self.assertEqual(self.snapshot(self.site, self.ext), before)

    def test_kill_during_the_jit_compile_then_gc_stale(self) -> None:
        self.package(jit_package("jitout", cache_inside=False))
        self.assertEqual(self.probe("jitout"), "4.0 plain")
        cache = os.path.join(self.ext, "jitout_op")
        before = self.snapshot(self.site, self.ext)
        patch = self.op_patch("jitout")
        # The tool's own build is the import: the tool and the compile die together.
        self.kill_when_compiling(OWN + [sys.executable, TOOL, "--state", self.state, "apply",
                                        patch, "--root", self.site, "--artifact",
                                        os.path.join(cache, "jitout_op.so"), "--build-cmd",
                                        "python -c 'import jitout'", "--build-cwd", self.site],
                                 "cc1plus")
        rc, out, err = call("gc-stale", "--root", self.tmp)
        self.assertEqual(rc, 0, err)
        self.assertIn("): reverted\n", out, err)
        self.assertEqual(self.snapshot(self.site, self.ext), before)
        # --no-build: the program's import compiles, and dies in the compile;
        # then its owner goes too.
        owner = subprocess.Popen(["sleep", "600"])
        self.addCleanup(owner.wait)
        self.addCleanup(owner.kill)
        self.assertOk(self.tool("apply", patch, "--root", self.site, "--artifact",
                                os.path.join(cache, "jitout_op.so"), "--no-build",
                                "--owner-pid", str(owner.pid)))
        self.kill_when_compiling([self.python, "-c", "import jitout"], "cc1plus")
        self.wait_for_started()
        self.assertTrue(os.path.exists(os.path.join(cache, ".ninja_lock")))
        owner.kill()
        owner.wait()
        rc, out, err = call("gc-stale", "--root", self.tmp)
        self.assertEqual(rc, 0, err)
        self.assertIn("): reverted\n", out)
        self.assertEqual(self.snapshot(self.site, self.ext), before)
        self.assertEqual(self.probe("jitout"), "4.0 plain")  # no wait on a lock, no compile
        self.assertEqual(self.snapshot(self.site, self.ext), before)

    def aot_build(self, cuda: bool) -> tuple:
        proj = self.package(aot_package(cuda), os.path.join(self.tmp, "aotproj"))
        build = [self.python, "setup.py", "build_ext", "--inplace"]
        quiet(build, proj).check_returncode()
        age_tree(proj)
        return proj, build

    def compiles_nothing(self, build: list, proj: str) -> None:
        output = quiet(build, proj).stdout
        self.assertNotRegex(output, r"(?m)^\[\d+/\d+\] ", output)

    def test_build_ext_inplace_update_revert_and_a_kill_during_the_build(self) -> None:
        proj, build = self.aot_build(cuda=False)
        on_python_path(self, proj)
        suffix = quiet([self.python, "-c", "import sysconfig; print(sysconfig.get_config_var("
                                           "'EXT_SUFFIX'))"], proj).stdout.strip()
        library = os.path.join(proj, "aot", "_op" + suffix)
        self.assertEqual(self.probe("aot"), "4.0 plain")
        before = self.snapshot(proj)
        rc, out, err = self.tool("apply", self.op_patch("aot", op="aot/op.cpp"), "--root", proj,
                                 "--artifact", library, "--build-cmd", " ".join(build),
                                 "--build-cwd", proj)
        self.assertEqual(rc, 0, err)
        self.assertEqual(len(re.findall(r"(?m)^\[    [\d.]+s\] \[1/1\] ", out)), 1, out)
        self.assertEqual(self.probe("aot"), "7.0 plain")
        self.assertOk(self.tool("update", self.op_patch("aot", "5.0", op="aot/op.cpp"),
                                "--root", proj))
        self.assertEqual(self.probe("aot"), "5.0 plain")
        rc, out, err = self.tool("revert")
        self.assertEqual((rc, err), (0, ""))
        self.assertEqual(self.snapshot(proj), before)
        # torch's BuildExtension copies the in-place library again on every
        # run, even one that compiles nothing
        self.compiles_nothing(build, proj)
        self.assertEqual(self.probe("aot"), "4.0 plain")
        before = self.snapshot(proj)  # what that run copied again
        self.kill_when_compiling(OWN + [sys.executable, TOOL, "--state", self.state, "apply",
                                        self.op_patch("aot", op="aot/op.cpp"), "--root", proj,
                                        "--artifact", library, "--build-cmd", " ".join(build),
                                        "--build-cwd", proj], "cc1plus")
        rc, out, err = call("gc-stale", "--root", self.tmp)
        self.assertEqual(rc, 0, err)
        self.assertIn("): reverted\n", out)
        self.assertEqual(self.snapshot(proj), before)
        self.compiles_nothing(build, proj)
        self.assertEqual(self.probe("aot"), "4.0 plain")

    def device_code(self, proj: str) -> bytes:
        """The fatbinary (cubin and PTX) nvcc put in the CUDA object."""
        objects = [os.path.join(directory, name) for directory, _, names in
                   os.walk(os.path.join(proj, "build")) for name in names if name == "kern.o"]
        self.assertEqual(len(objects), 1, objects)
        out = os.path.join(self.tmp, "fatbin")
        quiet(["objcopy", "-O", "binary", "--only-section=.nv_fatbin", objects[0], out],
              proj).check_returncode()
        with open(out, "rb") as handle:
            return handle.read()

    def test_cuda_extension_by_nvcc_and_a_kill_during_the_aot_build(self) -> None:
        if not self.cuda_home:
            self.skipTest("no nvcc on PATH, or it names no toolkit directory")
        proj, build = self.aot_build(cuda=True)
        before, code = self.snapshot(proj), self.device_code(proj)
        self.assertTrue(code)
        patch = self.patch("kern.diff", "aot/kern.cu", TORCH_KERNEL,
                           TORCH_KERNEL.replace("4.0f", "7.0f"))
        args = ["apply", patch, "--root", proj, "--build-cmd", " ".join(build),
                "--build-cwd", proj]
        self.assertOk(self.tool(*args))
        self.assertNotEqual(self.device_code(proj), code)
        self.assertOk(self.tool("revert"))
        self.assertEqual((self.snapshot(proj), self.device_code(proj)), (before, code))
        self.compiles_nothing(build, proj)
        before = self.snapshot(proj)  # what that run copied again
        self.kill_when_compiling(OWN + [sys.executable, TOOL, "--state", self.state] + args,
                                 "cicc")
        rc, out, err = call("gc-stale", "--root", self.tmp)
        self.assertEqual(rc, 0, err)
        self.assertEqual((self.snapshot(proj), self.device_code(proj)), (before, code))
        self.compiles_nothing(build, proj)

    def test_pip_editable_install_with_a_mixed_cpp_and_py_patch(self) -> None:
        proj = self.package(aot_package(cuda=False), os.path.join(self.tmp, "aotproj"))
        venv = os.path.join(self.tmp, "venv")
        quiet([self.python, "-m", "venv", "--without-pip", venv], self.tmp).check_returncode()
        python = os.path.join(venv, "bin", "python")
        purelib = quiet([python, "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
                        self.tmp).stdout.strip()
        torch_purelib = quiet([self.python, "-c", "import sysconfig; print(sysconfig.get_path("
                                                  "'purelib'))"], self.tmp).stdout.strip()
        write_text_file(os.path.join(purelib, "torch-venv.pth"), torch_purelib + "\n")
        install = "%s -m pip --python %s install -q --no-build-isolation --no-deps -e ." % (
            self.python, python)
        quiet(["sh", "-c", install], proj).check_returncode()
        os.environ["PYTHONPATH"] = ""  # the editable finder alone makes `aot` importable
        self.assertEqual(self.probe("aot", python), "4.0 plain")
        suffix = quiet([python, "-c", "import sysconfig; print(sysconfig.get_config_var("
                                      "'EXT_SUFFIX'))"], proj).stdout.strip()
        before = self.snapshot(proj)
        rc, out, err = self.tool("apply", self.op_patch("aot", op="aot/op.cpp", label=True),
                                 "--root", proj, "--python", python, "--artifact",
                                 os.path.join(proj, "aot", "_op" + suffix),
                                 "--build-cmd", install, "--build-cwd", proj)
        self.assertEqual(rc, 0, err)
        environment = json.loads(self.tool("env", "--json")[1])
        self.assertEqual(self.probe("aot", python, environment), "7.0 patched")
        self.assertEqual(self.probe("aot", python), "7.0 plain")  # the .py half: overlay only
        rc, out, err = self.tool("revert")
        self.assertEqual((rc, err), (0, ""))
        # pip rewrites its record of the install in the venv too: outside the
        # build directory, and not the tool's to give back.
        self.assertEqual(self.snapshot(proj), before)
        self.assertEqual(self.probe("aot", python, environment), "4.0 plain")


if __name__ == "__main__":
    unittest.main()


class BuildDirectoryTest(OverlayTestCase):
    """The directories a build writes in are found as the shell runs the
    command (cd, pushd, wrapper words, -C, --directory), with make building
    out of tree in ../build; where they cannot be told, nothing runs unless
    --build-dir names them."""

    MAKEFILE = ("VPATH = ../src\nlibk.so: k.o\n\t$(CC) -shared -o $@ k.o\n"
                "k.o: k.c\n\t$(CC) -O1 -fPIC -c -o $@ $<\n")

    def setUp(self) -> None:
        super().setUp()
        proj = self.built_copy(os.path.join(self.tmp, "proj"), {
            "src/k.c": "double k(void) { return 1.0; }\n", "build/Makefile": self.MAKEFILE},
            ["make", "-s", "-C", "build"], aged=True)
        self.src, self.build = os.path.join(proj, "src"), os.path.join(proj, "build")
        write_text_file(os.path.join(self.tmp, "fast.c"), "double k(void) { return 2.0; }\n")
        self.before = tree_state(proj)
        os.chdir(self.src)

    def add(self, command: str, *extra: str) -> tuple:
        return self.tool("add-native", "--source", os.path.join(self.src, "k.c"), "--patched",
                         os.path.join(self.tmp, "fast.c"), "--artifact",
                         os.path.join(self.build, "libk.so"), "--build-cmd", command, *extra)

    def test_an_out_of_tree_build_directory_comes_back_whatever_runs_make_there(self) -> None:
        for number, command in enumerate((
                "cd ../build && make", "nice -n 5 make -C ../build",
                        "env CC=cc make --directory=../build", "time -p make -C ../build",
                        "(cd ../build && make)", "nohup stdbuf -oL make -C ../build",
                "bash -c 'pushd ../build >/dev/null && make; popd'")):
            with self.subTest(command=command):
                self.state = os.path.join(self.tmp, "state%d" % number)
                rc, out, err = self.add(command)
                self.assertEqual(rc, 0, (out, err))
                self.assertIn("backed up 1 build product(s) the build may rewrite: %s"
                              % os.path.join(self.build, "k.o"), out)
                rc, out, err = self.tool("revert")
                self.assertEqual((rc, err), (0, ""), out)
                self.assertIn(checked(self.build, os.path.join(self.src, "k.c")), out)
                self.assertEqual(tree_state(os.path.dirname(self.src)), self.before)

    def test_the_folder_of_an_installed_artifact_is_watched_as_a_build_directory(self) -> None:
        # The prefix is set in the Makefile, where the command does not show
        # it: the installed library's folder is watched, and the small
        # version note the install rewrites beside it comes back too.
        prefix = os.path.join(self.tmp, "prefix")
        write_text_file(os.path.join(self.build, "prefix.mk"), "PREFIX = %s\n" % prefix)
        write_tree(self.build, {"Makefile": "include prefix.mk\n" + self.MAKEFILE +
                                "install: libk.so\n\tmkdir -p $(PREFIX)/lib\n"
                                "\tcp -p libk.so $(PREFIX)/lib/\n"
                                "\tdate +%N > $(PREFIX)/lib/installed.txt\n"})
        quiet(["make", "-s", "install"], self.build).check_returncode()
        age_tree(prefix)
        before = tree_state(prefix)
        installed = os.path.join(prefix, "lib", "libk.so")
        rc, out, err = self.tool("add-native", "--source", os.path.join(self.src, "k.c"),
                                 "--patched", os.path.join(self.tmp, "fast.c"), "--artifact",
                                 installed, "--build-cmd", "make -C ../build install")
        self.assertEqual(rc, 0, (out, err))
        rc, out, err = self.tool("revert")
        self.assertEqual((rc, err), (0, ""), out)
        self.assertIn(checked(os.path.join(prefix, "lib"), self.build,
                              os.path.join(self.src, "k.c")), out)
        self.assertEqual(tree_state(prefix), before)

    def test_a_command_the_shell_could_not_read_is_one_line_of_refusal(self) -> None:
        self.assertEqual(self.add("cd ../build && make 'oops"), (
            1, "", "overlay_setup: E123 cannot tell where the build command writes: `cd ../build "
            "&& make 'oops` cannot be read as the shell reads it (no closing quotation); nothing "
            "was changed: pass --build-dir DIR for each directory it writes in (repeatable)\n"))

    def test_a_build_directory_the_command_hides_is_refused_unless_named(self) -> None:
        os.environ.pop("OVERLAY_NO_SUCH_DIR", None)
        command = "cd $OVERLAY_NO_SUCH_DIR/../build && make"
        message = ("overlay_setup: E123 cannot tell where the build command writes: `cd "
                   "$OVERLAY_NO_SUCH_DIR/../build` names a directory only the shell knows; "
                   "nothing was changed: pass --build-dir DIR for each directory it writes in "
                   "(repeatable)\n")
        self.assertEqual(self.add(command), (1, "", message))
        rc, out, err = self.add(command, "--dry-run")
        self.assertEqual((rc, err), (1, message), out)
        self.assertEqual(tree_state(os.path.dirname(self.src)), self.before)
        rc, out, err = self.add("cd $PWD/../build && make", "--build-dir", "../build")
        self.assertEqual(rc, 0, (out, err))
        self.assertOk(self.tool("revert"))
        self.assertEqual(tree_state(os.path.dirname(self.src)), self.before)


def file_hashes(*roots: str) -> dict:
    """path -> sha256 of every regular file under `roots` (a symlink: its target)."""
    found = {}
    for root in roots:
        for directory, dirs, files in os.walk(root):
            for name in files:
                path = os.path.join(directory, name)
                if os.path.islink(path):
                    found[path] = "-> " + os.readlink(path)
                else:
                    with open(path, "rb") as handle:
                        found[path] = hashlib.sha256(handle.read()).hexdigest()
    return found


class PipInstallTest(OverlayTestCase):
    """A C extension package installed by a plain `pip install .` into a
    venv: its artifact lies in an installed distribution, whose files (its
    RECORD lists them) and dist-info come back with no flag."""

    @classmethod
    def setUpClass(cls) -> None:
        """One venv that can build wheels, copied for each test (its python
        is a link to this interpreter, its prefix where pyvenv.cfg lies)."""
        base = tempfile.mkdtemp(prefix="overlay-pip-")
        cls.addClassCleanup(shutil.rmtree, base, True)
        cls.venv = os.path.join(base, "venv")
        quiet([sys.executable, "-m", "venv", "--without-pip", "--system-site-packages",
               cls.venv], base).check_returncode()
        python = os.path.join(cls.venv, "bin", "python")
        cls.usable = not quiet([python, "-c", "import setuptools, wheel"], base).returncode or \
            not quiet([python, "-m", "pip", "install", "-q", "wheel"], base).returncode

    def setUp(self) -> None:
        super().setUp()
        if not self.usable:
            self.skipTest("pip cannot build a wheel in a venv here: neither setuptools and wheel "
                          "are importable nor can pip install wheel")
        venv = os.path.join(self.tmp, "venv")
        shutil.copytree(self.venv, venv, symlinks=True)
        self.python = os.path.join(venv, "bin", "python")
        self.site = subprocess.run([self.python, "-c", "import sysconfig; "
                                    "print(sysconfig.get_paths()['purelib'])"],
                                   stdout=subprocess.PIPE, universal_newlines=True,
                                   check=True).stdout.strip()
        self.proj = os.path.join(self.tmp, "proj")
        write_tree(self.proj, EXTENSION_PROJECT)
        self.install = "%s -m pip install -q --no-build-isolation --no-deps ." % self.python
        done = quiet(self.install.split(), self.proj)
        self.assertEqual(done.returncode, 0, done.stdout)
        age_tree(self.proj)  # setuptools rebuilds what is older than its source, by the second
        suffix = subprocess.run([self.python, "-c", "import sysconfig; "
                                 "print(sysconfig.get_config_var('EXT_SUFFIX'))"],
                                stdout=subprocess.PIPE, universal_newlines=True,
                                check=True).stdout.strip()
        self.artifact = os.path.join(self.site, "pkg", "_k" + suffix)
        write_text_file(os.path.join(self.tmp, "fast.c"), EXTENSION_PROJECT["pkg/_k.c"].replace(
            "(4)", "(7)"))
        self.before = file_hashes(self.site, self.proj)

    def k(self) -> str:
        return subprocess.run([self.python, "-c", "import pkg._k; print(pkg._k.value())"],
                              stdout=subprocess.PIPE, universal_newlines=True, cwd=self.tmp,
                              check=True).stdout

    def test_pip_install_dot_reverts_every_file_of_the_venv_and_the_project(self) -> None:
        rc, out, err = self.tool("add-native", "--source", os.path.join(self.proj, "pkg", "_k.c"),
                                 "--patched", os.path.join(self.tmp, "fast.c"), "--artifact",
                                 self.artifact, "--build-cmd", self.install, "--build-cwd",
                                 self.proj)
        self.assertEqual(rc, 0, (out, err))
        self.assertEqual(self.k(), "7\n")
        rc, out, err = self.tool("revert")
        self.assertEqual((rc, err), (0, ""), out)
        self.assertEqual(self.k(), "4\n")
        self.assertEqual(file_hashes(self.site, self.proj), self.before)

    def test_the_files_of_the_distribution_are_counted_not_listed_when_backed_up(self) -> None:
        os.chdir(self.proj)
        rc, out, err = self.tool("add-native", "--source", os.path.join(self.proj, "pkg", "_k.c"),
                                 "--patched", os.path.join(self.tmp, "fast.c"), "--artifact",
                                 self.artifact, "--build-cmd", self.install)
        self.assertEqual(rc, 0, (out, err))
        line = out.splitlines()[0]
        dist_info = os.path.join(self.site, "pkg-0.dist-info")
        kept = len(overlay_setup.distribution_files(dist_info)) - 1  # less the artifact
        self.assertRegex(line, r"^backed up \d+ build product\(s\) the build may rewrite: the %d "
                               r"files installed with pkg-0.dist-info, build/" % kept)
        self.assertNotIn(self.site, line)
        self.assertOk(self.tool("revert"))
        self.assertEqual(file_hashes(self.site, self.proj), self.before)

    def test_revert_gives_the_site_folder_its_mtime_back(self) -> None:
        # pip stashes the distribution's folders beside them and makes them
        # anew: the site folder's own entries change, and with them its mtime.
        site_mtime = os.stat(self.site).st_mtime_ns
        self.assertOk(self.tool("add-native", "--source", os.path.join(self.proj, "pkg", "_k.c"),
                                "--patched", os.path.join(self.tmp, "fast.c"), "--artifact",
                                self.artifact, "--build-cmd", self.install, "--build-cwd",
                                self.proj))
        self.assertNotEqual(os.stat(self.site).st_mtime_ns, site_mtime)
        self.assertOk(self.tool("revert"))
        self.assertEqual(os.stat(self.site).st_mtime_ns, site_mtime)

    def trial(self, build: str) -> subprocess.CompletedProcess:
        diff = os.path.join(self.tmp, "two.diff")
        write_text_file(diff, "--- a/pkg/_k.c\n+++ b/pkg/_k.c\n@@ -2 +2 @@\n-%s+%s" % (
            EXTENSION_PROJECT["pkg/_k.c"].splitlines(True)[1],
            EXTENSION_PROJECT["pkg/_k.c"].splitlines(True)[1].replace("(4)", "(7)")))
        return forked_tool(["--state", self.state, "trial", diff, "--root", self.proj,
                            "--artifact", self.artifact, "--build-cmd", build, "--build-cwd",
                            self.proj, "--", self.python, "-c",
                            "import pkg._k; print(pkg._k.value())"])

    def test_trial_of_pip_install_dot_watches_the_distribution(self) -> None:
        done = self.trial(self.install)
        self.assertEqual(done.returncode, 0, (done.stdout, done.stderr))
        self.assertIn("  watched: %s (writes elsewhere" % ", ".join(sorted([
            self.proj, os.path.join(self.site, "pkg-0.dist-info"),
            os.path.join(self.site, "pkg")])), done.stdout)
        self.assertIn("output: differs (round 1, line 1): reference \"4\", candidate \"7\"",
                      done.stdout)
        self.assertIn("  revert: the install is byte-identical to before", done.stdout)
        self.assertEqual(file_hashes(self.site, self.proj), self.before)

    def test_trial_says_the_install_differs_when_a_file_of_the_distribution_is_not_back(
            self) -> None:
        # A large file beside the package, which no RECORD lists and nothing
        # backs up, rewritten by the build: revert cannot give it back.
        data = os.path.join(self.site, "pkg", "table.bin")
        with open(data, "wb") as handle:
            handle.write(b"\0" * (300 << 10))
        done = self.trial(self.install + " && printf x >> %s" % data)
        self.assertEqual(done.returncode, 14, (done.stdout, done.stderr))
        self.assertIn("  revert: the install differs from before: %s" % data, done.stdout)


    def test_the_plan_names_the_distribution_once_not_each_file(self) -> None:
        rc, out, err = self.tool("add-native", "--source", os.path.join(self.proj, "pkg", "_k.c"),
                                 "--patched", os.path.join(self.tmp, "fast.c"), "--artifact",
                                 self.artifact, "--build-cmd", self.install, "--build-cwd",
                                 self.proj, "--dry-run")
        self.assertEqual((rc, err), (0, ""), out)
        dist_info = os.path.join(self.site, "pkg-0.dist-info")
        count = len(overlay_setup.distribution_files(dist_info)) - 1  # the artifact's own line
        self.assertIn("  keep       the %d other files of the installed distribution %s (its "
                      "RECORD and dist-info), each by a hard link: pip writes files anew\n"
                      % (count, dist_info), out)
        self.assertNotIn("RECORD (build product", out)
        self.assertEqual(file_hashes(self.site, self.proj), self.before)

class ReadableOutputTest(OverlayTestCase):
    """What the tool prints is read by a person at a terminal: the next
    command to run as that person would type it from where they stand."""

    def setUp(self) -> None:
        super().setUp()
        environ = unittest.mock.patch.dict(os.environ)
        environ.start()
        self.addCleanup(environ.stop)
        os.environ.pop("OVERLAY_STATE", None)
        write_tree(self.tmp, {"k.c": "int k(void) { return 1; }\n",
                              "fast.c": "int k(void) { return 2; }\n"})

    def test_a_hint_names_the_state_directory_only_where_it_is_needed(self) -> None:
        rc, out, err = call("add-native", "--source", "k.c", "--patched", "fast.c", "--no-build")
        self.assertEqual((rc, err), (0, ""), out)
        state = re.search(r"^state: (.*)$", out, re.M).group(1)
        self.assertIn("; run `overlay_setup.py revert` to take it back\n", out)
        os.mkdir("sub")
        os.chdir("sub")
        rc, out, err = call("--state", state, "status")
        self.assertEqual(out.splitlines()[-1],
                         "next: build, measure, then `overlay_setup.py --state %s revert`" % state)
        os.environ["OVERLAY_STATE"] = state
        rc, out, err = call("status")
        self.assertEqual(out.splitlines()[-1], "next: build, measure, then `overlay_setup.py revert`")

    def test_paths_are_shown_from_the_current_directory_and_a_long_list_is_summed_up(self) -> None:
        artifacts = []
        for number in range(1, 8):
            write_tree(self.tmp, {"d%d/lib.so" % number: "x\n"})
            artifacts += ["--artifact", os.path.join(self.tmp, "d%d" % number, "lib.so")]
        rc, out, err = call("add-native", "--source", os.path.join(self.tmp, "k.c"), "--patched",
                            "fast.c", "--no-build", *artifacts)
        state = re.search(r"^state: (.*)$", out, re.M).group(1)
        self.assertEqual((rc, out.splitlines()[-1], err), (
            0, "entry 1 applied without a build: k.c; run `overlay_setup.py revert` to take it back",
            ""))
        self.assertEqual(call("revert"), (
            0, "entry 1 restored: k.c\n"
               "checked d1/lib.so, d2/lib.so, d3/lib.so, d4/lib.so, and 4 more; a build's writes "
               "outside them (an install step into a prefix) are not, unless named with "
               "--build-dir or --artifact\nreverted %s\n" % state, ""))

    def test_add_python_says_it_serves_a_copy_and_how_to_turn_it_on(self) -> None:
        write_tree(self.tmp, {"pkg/__init__.py": "", "pkg/ops.py": "SCALE = 2\n",
                              "ops_fast.py": "SCALE = 3\n"})
        rc, out, err = call("add-python", "pkg.ops", "ops_fast.py")
        state = re.search(r"^state: (.*)$", out, re.M).group(1)
        self.assertEqual((rc, out, err), (
            0, "module pkg.ops now served from a copy of ops_fast.py taken now (edit the file "
               "later and it is not seen) to Python processes started after "
               "`eval \"$(overlay_setup.py env)\"`\nstate: %s\n" % state, ""))
        write_text_file("ops_fast.py", "SCALE = 9\n")
        environ = dict(os.environ, PYTHONPATH="%s/site:%s" % (state, self.tmp))
        self.assertEqual(subprocess.run(
            [sys.executable, "-c", "import pkg.ops; print(pkg.ops.SCALE)"], env=environ,
            cwd=self.tmp, stdout=subprocess.PIPE, universal_newlines=True).stdout, "3\n")
        self.assertOk(call("revert"))

    def test_files_the_build_rewrote_are_shown_from_here_and_summed_up(self) -> None:
        os.mkdir("proj")
        os.chdir("proj")
        write_tree(".", {"v%d.txt" % n: "old\n" for n in range(1, 7)})
        rc, out, err = call("add-native", "--source", os.path.join(self.tmp, "k.c"),
                            "--patched", os.path.join(self.tmp, "fast.c"), "--build-cmd",
                            "for n in 1 2 3 4 5 6; do echo new > v$n.txt; done")
        self.assertEqual(rc, 0, (out, err))
        self.assertIn("\nthe build rewrote or deleted v1.txt, v2.txt, v3.txt, v4.txt, and 2 more; "
                      "revert puts back the copies taken before it\n", out)
        self.assertOk(call("revert"))
        self.assertEqual(read_text("v6.txt"), "old\n")

    def test_an_artifact_the_build_did_not_make_is_named_as_missing(self) -> None:
        os.mkdir("proj")
        os.chdir("proj")
        rc, out, err = call("add-native", "--source", os.path.join(self.tmp, "k.c"), "--patched",
                            os.path.join(self.tmp, "fast.c"), "--artifact", "libk_typo.so",
                            "--build-cmd", "true")
        self.assertEqual((rc, err[:38]), (1, "overlay_setup: E404 the build finished"), out)
        self.assertRegex(err, r"^overlay_setup: E404 the build finished in \d+\.\ds and changed no "
                              r"--artifact: %s does not exist; the patch stays applied for "
                              r"inspection: run `overlay_setup.py revert`, then apply again with "
                              r"the --artifact the build writes \(or check --build-cmd and "
                              r"--build-cwd\)\n$" % "libk_typo.so")
        self.assertOk(call("revert"))

    def test_revert_all_with_nothing_applied_names_where_it_looked(self) -> None:
        self.assertEqual(call("revert", "--all"), (
            0, "nothing to revert: no applied overlay in %s\n" % overlay_setup.state_home(), ""))

    def test_gc_stale_removes_reverted_state_directories_of_the_state_home_only(self) -> None:
        rc, out, err = call("add-native", "--source", "k.c", "--patched", "fast.c", "--no-build")
        default = re.search(r"^state: (.*)$", out, re.M).group(1)
        self.assertOk(call("revert"))
        self.assertOk(call("--state", self.state, "add-native", "--source", "k.c", "--patched",
                           "fast.c", "--no-build"))
        self.assertOk(call("--state", self.state, "revert"))
        self.assertTrue(os.path.isdir(default))
        self.assertEqual(call("gc-stale", "--dry-run")[0], 0)
        self.assertTrue(os.path.isdir(default))
        home = os.path.dirname(default)
        self.assertEqual(call("gc-stale"), (
            0, "removed 1 state directory with nothing applied from %s\n"
               "nothing stale: 2 state directories with nothing applied under %s or in the "
               "registry\n" % (home, self.tmp), ""))
        self.assertEqual(sorted(os.listdir(home)), ["applied"])  # the registry of --state directories
        self.assertTrue(os.path.isdir(self.state))  # one the user named is the user's
        self.assertOk(call("add-native", "--source", "k.c", "--patched", "fast.c", "--no-build"))
        self.assertOk(call("revert"))


    def test_gc_stale_removes_them_also_where_its_root_does_not_hold_the_state_home(self) -> None:
        # The examples end with `gc-stale --root "$demo"`: the state home
        # lies outside the demo, and its reverted directory must go too.
        os.mkdir("demo")
        os.chdir("demo")
        rc, out, err = call("add-native", "--source", os.path.join(self.tmp, "k.c"), "--patched",
                            os.path.join(self.tmp, "fast.c"), "--no-build")
        default = re.search(r"^state: (.*)$", out, re.M).group(1)
        self.assertOk(call("revert"))
        self.assertEqual(call("gc-stale", "--root", "."), (
            0, "removed 1 state directory with nothing applied from %s\n"
               "nothing stale: 1 state directory with nothing applied under %s or in the "
               "registry\n" % (os.path.dirname(default), os.path.join(self.tmp, "demo")), ""))
        self.assertFalse(os.path.exists(default))

class InterruptedApplyTest(OverlayTestCase):
    """Ctrl-C during add-native or apply takes back what that run applied,
    as pip or git would; a second Ctrl-C leaves it to `revert`."""

    def setUp(self) -> None:
        super().setUp()
        write_tree(self.tmp, {"proj/k.c": "int k(void) { return 1; }\n",
                              "fast.c": "int k(void) { return 2; }\n",
                              "fix.diff": "--- a/k.c\n+++ b/k.c\n@@ -1 +1 @@\n"
                                          "-int k(void) { return 1; }\n+int k(void) { return 3; }\n"})
        self.source = os.path.join(self.tmp, "proj", "k.c")
        self.here = "overlay_setup.py --state %s" % self.state

    def interrupt_build(self, *argv: str) -> tuple:
        """Run the tool, SIGINT it once its build printed `started`: (rc, stderr)."""
        proc = subprocess.Popen([sys.executable, TOOL, "--state", self.state] + list(argv)
                                + ["--build-cmd", "echo started; sleep 30"], cwd=self.tmp,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                universal_newlines=True)
        try:
            for line in proc.stdout:
                if "started" in line:
                    break
            else:
                self.fail("the build never started: %s" % proc.stderr.read())
            proc.send_signal(signal.SIGINT)
            _, err = proc.communicate(timeout=60)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        return proc.returncode, err

    def assert_nothing_applied(self) -> None:
        with open(self.source) as handle:
            self.assertEqual(handle.read(), "int k(void) { return 1; }\n")
        rc, out, err = self.tool("status")
        self.assertIn(out.splitlines()[-1], ("next: nothing applied; nothing to do",
                                             "no overlay at %s" % self.state), out)

    def test_ctrl_c_during_the_build_of_add_native_or_apply_reverts_what_it_applied(self) -> None:
        for argv in (["add-native", "--source", self.source, "--patched", "fast.c"],
                     ["apply", "fix.diff", "--root", "proj"]):
            with self.subTest(command=argv[0]):
                rc, err = self.interrupt_build(*argv, "--build-cwd", "proj")
                self.assertEqual((rc, err.splitlines()[-2:]), (130, [
                    "overlay_setup: interrupted; reverting what this run applied (Ctrl-C again "
                    "leaves it to `%s revert`)" % self.here,
                    "overlay_setup: interrupted; what this run applied is reverted"]), err)
                self.assert_nothing_applied()

    def test_a_second_ctrl_c_leaves_the_revert_to_revert_and_says_so(self) -> None:
        # Real SIGINTs, sent at two changes in a row (OVERLAY_TEST_KILL_AT):
        # the first pair where the first lands in the apply and the second in
        # the revert the first one started.
        for point in range(1, 40):
            done = subprocess.run([sys.executable, TOOL, "--state", self.state, "add-native",
                                   "--source", self.source, "--patched", "fast.c", "--no-build"],
                                  cwd=self.tmp, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                  universal_newlines=True,
                                  env=dict(os.environ, OVERLAY_TEST_KILL_AT="%d,%d" % (point, point + 1),
                                           OVERLAY_TEST_KILL_SIGNAL="INT"))
            if "interrupted again" in done.stderr or done.returncode != 130:
                break
            self.assert_nothing_applied()
        self.assertEqual((done.returncode, done.stderr), (130, (
            "overlay_setup: interrupted; reverting what this run applied (Ctrl-C again leaves it "
            "to `{0} revert`)\n"
            "overlay_setup: interrupted again: that revert stopped halfway\n"
            "overlay_setup: interrupted; run `{0} status`, then `{0} revert`\n").format(self.here)))
        self.assertOk(self.tool("revert"))
        self.assert_nothing_applied()



class BuildEndTest(MadePackageTest):
    """A build is over when its whole process group and session are gone: a
    job it leaves in the background is waited for, and one that outlives
    the limit is stopped and named."""

    PATCHED = ("fast.c", "faster.c")

    def add(self, build: str) -> subprocess.CompletedProcess:
        return forked_tool(["--state", self.state, "add-native", "--source",
                            os.path.join(self.pkg, "k.c"), "--patched",
                            os.path.join(self.tmp, "fast.c"), "--build-cmd", build,
                            "--build-cwd", self.pkg, "--owner-pid", str(os.getpid())])

    def test_a_job_the_build_leaves_in_the_background_is_part_of_the_build(self) -> None:
        library = os.path.join(self.pkg, "libk.so")
        original = overlay_setup.file_sha256(library)
        done = self.add("make && { sleep 2; touch patched.o; } &")
        self.assertEqual(done.returncode, 0, done.stderr)
        self.assertNotEqual(overlay_setup.file_sha256(library), original)
        self.assertIn("warning: the build created files that no --artifact or --invalidate-cache "
                      "covers (revert removes them): %s\n" % os.path.join(self.pkg, "patched.o"),
                      done.stderr)
        self.assertOk(self.tool("revert"))
        self.assertEqual(tree_state(self.pkg), self.before)

    def test_the_output_of_a_job_left_in_the_background_is_read_to_its_end(self) -> None:
        # Past OUTPUT_GRACE, while the group lives: a closed pipe would end
        # the job at its next line (SIGPIPE), before it wrote patched.o.
        grace, overlay_setup.OUTPUT_GRACE = overlay_setup.OUTPUT_GRACE, 0.2
        try:
            done = self.add("make -s && { sleep 1; echo late; touch patched.o; } &")
        finally:
            overlay_setup.OUTPUT_GRACE = grace
        self.assertEqual(done.returncode, 0, done.stderr)
        self.assertRegex(done.stdout, r"\] late\n")
        self.assertIn("(revert removes them): %s\n" % os.path.join(self.pkg, "patched.o"),
                      done.stderr)
        self.assertOk(self.tool("revert"))
        self.assertEqual(tree_state(self.pkg), self.before)

    def test_revert_stops_the_job_of_a_run_killed_while_it_waited_for_it(self) -> None:
        with open(os.devnull, "w") as devnull:
            tool = fork_tool(["--state", self.state, "add-native", "--source",
                              os.path.join(self.pkg, "k.c"), "--patched",
                              os.path.join(self.tmp, "fast.c"), "--build-cmd",
                              # its output elsewhere: a write into the pipe of the killed
                              # run would end it (SIGPIPE)
                              "{ make && sleep 60 && touch late.o; } >/dev/null 2>&1 &",
                              "--build-cwd", self.pkg],
                             {}, True, devnull.fileno(), devnull.fileno())
        journal = os.path.join(self.state, "journal.json")
        leader = None
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:  # until the shell is gone and its job sleeps
            with contextlib.suppress(OSError, ValueError, IndexError, KeyError, TypeError):
                leader = read_json(journal)["entries"][-1]["build"]["process"]["pid"]
                live = [pid for pid, _ in overlay_setup.live_process_stats()]
                if leader not in live and "sleep" in map(
                        overlay_setup.process_name, overlay_setup.group_members(leader)):
                    break
            time.sleep(0.01)
        os.kill(tool, signal.SIGKILL)
        os.waitpid(tool, 0)
        self.assertTrue(leader and overlay_setup.group_members(leader), "no job was seen running")
        rc, out, err = self.tool("revert")
        self.assertEqual(rc, 0, (out, err))
        self.assertIn("stopping the build that entry 1 left running (process group %d)" % leader,
                      err)
        self.assertEqual(overlay_setup.group_members(leader), [])
        self.assertEqual(tree_state(self.pkg), self.before)

    def test_a_process_that_outlives_the_limit_is_stopped_and_named(self) -> None:
        pid_file = os.path.join(self.tmp, "lingerer.pid")
        limit, overlay_setup.LINGER_LIMIT = overlay_setup.LINGER_LIMIT, 0.5
        try:
            done = self.add("make && { sh -c 'echo $$ > %s; exec sleep 60' >/dev/null & }"
                            % pid_file)
        finally:
            overlay_setup.LINGER_LIMIT = limit
        self.assertEqual(done.returncode, 0, done.stderr)
        pid = int(read_text(pid_file))  # gone, or a zombie its new parent has yet to reap
        self.assertNotIn(pid, [live for live, _ in overlay_setup.live_process_stats()])
        self.assertIn("warning: the build's shell exited, but process %d (sleep) of its process "
                      "group still ran 0.5s later; it was stopped, and the build taken as over\n"
                      % pid, done.stderr)
        self.assertOk(self.tool("revert"))
        self.assertEqual(tree_state(self.pkg), self.before)


class ComeBackTest(MadePackageTest):
    """How files come back: an empty directory the build removed, a sparse
    file's holes, a file with hard links outside the tree, and a revert on a
    disk the build filled."""

    PATCHED = ("fast.c", "faster.c")

    def add(self, build: str, *extra: str) -> tuple:
        return self.tool("add-native", "--source", os.path.join(self.pkg, "k.c"), "--patched",
                         os.path.join(self.tmp, "fast.c"), "--build-cmd", build, "--build-cwd",
                         self.pkg, *extra)

    def test_an_empty_directory_the_build_removed_comes_back(self) -> None:
        # As CMake drops its scratch folders: empty ones, nested too.
        os.makedirs(os.path.join(self.pkg, "scratch", "inner"))
        os.makedirs(os.path.join(self.pkg, "tmp"))
        age_tree(self.pkg)
        before = tree_state(self.pkg)
        self.assertOk(self.add("make && rm -r scratch && rmdir tmp"))
        self.assertFalse(os.path.exists(os.path.join(self.pkg, "scratch")))
        rc, out, err = self.tool("revert")
        self.assertEqual((rc, err), (0, ""), out)
        self.assertEqual(tree_state(self.pkg), before)

    def test_a_sparse_file_in_a_cache_snapshotted_with_tar_keeps_its_holes(self) -> None:
        # /dev/shm is another filesystem than the state: the cache goes into a tar.
        cache = tempfile.mkdtemp(prefix="overlay-sparse-", dir="/dev/shm")
        self.addCleanup(shutil.rmtree, cache, True)
        sparse = os.path.join(cache, "kernels.bin")
        with open(sparse, "wb") as handle:
            handle.seek(50 << 20)
            handle.write(b"k" * 4096)
            handle.truncate(100 << 20)
        blocks = os.stat(sparse).st_blocks
        if blocks * 512 >= 1 << 20:
            self.skipTest("/dev/shm keeps no holes here")
        before = tree_state(cache)
        rc, out, err = self.add("make", "--invalidate-cache", cache)
        self.assertEqual(rc, 0, (out, err))
        self.assertIn('"method": "tar"', read_text(os.path.join(self.state, "journal.json")))
        self.assertOk(self.tool("revert"))
        self.assertEqual(tree_state(cache), before)
        self.assertEqual(os.stat(sparse).st_blocks, blocks)

    def test_an_artifact_with_a_hard_link_outside_comes_back_through_its_inode(self) -> None:
        # As uv's hardlink install mode shares a library with its cache: the
        # build writes it in place (the cache's name sees the patch) or
        # replaces it (the name leaves the cache's inode); either way revert
        # gives the name its inode back, with the original content.
        library = os.path.join(self.pkg, "libk.so")
        original = read_text_bytes(library)
        for build in ("make && cat k.o >> libk.so", "make -B"):
            with self.subTest(build=build):
                shared = os.path.join(self.tmp, "uv-cache", "libk.so")
                os.makedirs(os.path.dirname(shared), exist_ok=True)
                if os.path.lexists(shared):
                    os.unlink(shared)
                os.link(library, shared)
                rc, out, err = self.add(build, "--artifact", library)
                self.assertEqual(rc, 0, (out, err))
                self.assertOk(self.tool("revert"))
                self.assertEqual(read_text_bytes(shared), original)
                self.assertTrue(os.path.samefile(library, shared))
                os.unlink(shared)
                self.assertEqual(tree_state(self.pkg), self.before)


def read_text_bytes(path: str) -> bytes:
    with open(path, "rb") as handle:
        return handle.read()


class HardLinkedArtifactTest(MadePackageTest):
    """An artifact whose inode revert must give back cannot be, from a state
    directory on another filesystem: refused before anything changes."""

    def test_a_hard_linked_artifact_with_the_state_on_another_filesystem_is_refused(self) -> None:
        library = os.path.join(self.pkg, "libk.so")
        os.link(library, os.path.join(self.tmp, "libk-shared.so"))
        state = tempfile.mkdtemp(prefix="overlay-state-", dir="/dev/shm")
        self.addCleanup(shutil.rmtree, state, True)
        before = tree_state(self.pkg)
        self.assertEqual(call("--state", state, "add-native", "--source",
                              os.path.join(self.pkg, "k.c"), "--patched",
                              os.path.join(self.tmp, "k_new.c"), "--artifact", library,
                              "--build-cmd", "make", "--build-cwd", self.pkg), (
            1, "", "overlay_setup: E106 --artifact %s has 2 hard links, and the state directory "
            "%s is on another filesystem or mount, so revert could not give the links their file "
            "back; pass a --state on the same mount\n" % (library, state)))
        self.assertEqual(tree_state(self.pkg), before)


class DiskFullTest(OverlayTestCase):
    """A build that fills the disk with its own new file: the journal is
    still written, and revert frees the space and finishes."""

    def setUp(self) -> None:
        super().setUp()
        self.disk = os.path.join(self.tmp, "disk")
        os.mkdir(self.disk)
        if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=3m", "tmpfs", self.disk],
                          stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL).returncode:
            self.skipTest("cannot mount a tmpfs here (mount needs root or CAP_SYS_ADMIN)")
        self.addCleanup(subprocess.run, ["umount", "-l", self.disk])
        self.pkg = self.built_copy(os.path.join(self.disk, "pkg"), {
            "k.c": "double k(void) { return 1.0; }\n", "Makefile": MadePackageTest.MAKEFILE},
            ["make", "-s"], aged=True)
        write_text_file(os.path.join(self.tmp, "fast.c"), "double k(void) { return 2.0; }\n")
        self.state = os.path.join(self.disk, "state")

    def test_a_build_that_fills_the_disk_is_journaled_and_reverted(self) -> None:
        before = tree_state(self.pkg)
        rc, out, err = self.tool("add-native", "--source", os.path.join(self.pkg, "k.c"),
                                 "--patched", os.path.join(self.tmp, "fast.c"), "--build-cmd",
                                 "make && { head -c 5000000 /dev/zero > filler.o; true; }",
                                 "--build-cwd", self.pkg)
        self.assertEqual((rc, err.count("E601")), (0, 0), (out, err))
        # the build's file took all the space there was: the reserve's is all that is free
        self.assertGreater(os.path.getsize(os.path.join(self.pkg, "filler.o")), 1 << 20)
        self.assertLess(os.statvfs(self.disk).f_bavail * os.statvfs(self.disk).f_frsize,
                        overlay_setup.RESERVE_SIZE + (64 << 10))
        rc, out, err = self.tool("revert")
        self.assertEqual((rc, err), (0, ""), out)
        self.assertEqual(tree_state(self.pkg), before)


class TrialWatchedTest(OverlayTestCase):
    """trial's verdict covers everything the overlay is responsible for, and
    its watched: line names it all: the build directories read from the
    command, the caches set aside, the files kept by --protect."""

    def test_the_watched_line_names_caches_protected_files_and_build_directories(self) -> None:
        proj = self.built_project(TRIAL_PROJECT)
        cache = os.path.join(self.tmp, "cache")
        write_tree(cache, {"entry": "cached\n"})
        notes = os.path.join(self.tmp, "notes.txt")
        write_text_file(notes, "kept\n")
        diff = os.path.join(self.tmp, "seven.diff")
        write_text_file(diff, "--- a/b.c\n+++ b/b.c\n@@ -2 +2 @@\n"
                              "-int b(void) { return K; }\n+int b(void) { return 7; }\n")
        work = os.path.join(self.tmp, "work")
        os.mkdir(work)
        os.chdir(work)
        done = forked_tool(["--state", self.state, "trial", diff, "--root", proj,
                            "--invalidate-cache", cache, "--protect", notes,
                            "--build-cmd", "cd ../proj && make", "--", "true"])
        self.assertEqual(done.returncode, 0, (done.stdout, done.stderr))
        self.assertIn("  watched: %s (writes elsewhere" % ", ".join([cache, notes, proj, work]),
                      done.stdout)
