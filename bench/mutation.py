#!/usr/bin/env python3
"""Mutation run of the two tools' tests: does the suite fail when a tool breaks?

Each mutant below is a plausible regression of one promise, written as an
edit of the tool's text: an exact pattern, which must occur exactly once in
the file, and its replacement.  For each mutant the repository is copied to
a temporary directory once, the edit is made there, the test classes named
with it are run (`python3 -m unittest -f CLASSES`), and the file is put
back.  A mutant is killed when those tests fail (or run past --timeout),
survives when they pass.  First the named classes run on the unchanged copy:
a class that fails there would kill every mutant and prove nothing.

A pattern that no longer occurs once in its file is an error before anything
runs: the list is kept working as the tools change, by editing the mutant
so that it breaks the same promise in the new code.

Usage:
  python3 bench/mutation.py                 # every mutant
  python3 bench/mutation.py NAME [NAME...]  # the mutants named
  python3 bench/mutation.py --list          # the mutants, their files and classes

Slow (each mutant runs its classes; the whole list takes tens of minutes on
a 2-core machine), so it is not part of .ci/run.

Exit codes: 0 every mutant killed, 1 some survived, 2 usage: an unknown name,
a pattern that does not occur exactly once, an edit that does not compile, or
a class that fails unmutated.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from typing import List, NamedTuple

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OVERLAY, CHECKER = "overlay_setup.py", "check_contract.py"


class Mutant(NamedTuple):
    name: str
    file: str
    pattern: str
    replacement: str
    classes: tuple  # the test classes, as module.Class, that must catch it


def overlay(name: str, pattern: str, replacement: str, *classes: str) -> Mutant:
    return Mutant(name, OVERLAY, pattern, replacement,
                  tuple("test_overlay_native." + c for c in classes))


def checker(name: str, pattern: str, replacement: str, *classes: str) -> Mutant:
    return Mutant(name, CHECKER, pattern, replacement,
                  tuple("test_check_contract." + c for c in classes))


MUTANTS = [
    # overlay_setup.py: ownership and gc-stale
    overlay("other-host-owner-is-gone",
            '    if owner.get("host") != host_name():\n        return "other-host"\n', "",
            "OtherHostTest"),
    overlay("other-host-interrupted-entry-is-live",
            'if liveness != "gone" and crashed is None:',
            'if liveness == "other-host" or liveness != "gone" and crashed is None:',
            "OtherHostTest"),
    overlay("reused-pid-is-the-owner",
            '    if recorded is not None and process_start_time(pid) != recorded:\n        return "gone"\n',
            "", "GcStaleTest"),
    overlay("owner-pid-need-not-run", "if pid <= 0 or not pid_exists(pid):", "if pid <= 0:",
            "HostileArgumentTest", "CProjectTest"),
    overlay("gc-stale-dry-run-reverts",
            '                    print("stale: %s (%s): would revert" % (directory, why))\n'
            '                    continue\n',
            '                    print("stale: %s (%s): would revert" % (directory, why))\n',
            "GcStaleTest", "OtherHostTest"),
    overlay("lock-is-shared", "        try:\n            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)\n"
            "        except BlockingIOError:\n            os.close(fd)\n            return False\n"
            "        self._hold(fd, command)\n",
            "        try:\n            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)\n"
            "        except BlockingIOError:\n            os.close(fd)\n            return False\n"
            "        self._hold(fd, command)\n", "GcStaleTest"),
    overlay("group-writable-state-accepted", "if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):",
            "if False:", "GcStaleTest", "StateDirectorySafetyTest"),
    overlay("state-others-can-enter-keeps-backups", "        if st.st_mode & stat.S_IXOTH:\n",
            "        if False:\n", "StateDirectorySafetyTest"),
    # overlay_setup.py: journaling order
    overlay("journal-renamed-before-its-fsync",
            "        os.fchmod(fd, mode)\n        os.fsync(fd)\n", "        os.fchmod(fd, mode)\n",
            "JournalDurabilityTest"),
    overlay("journal-directory-not-fsynced",
            "    os.replace(tmp, path)\n    fsync_dir(os.path.dirname(path))\n",
            "    os.replace(tmp, path)\n", "JournalDurabilityTest"),
    overlay("entry-journaled-after-the-swap",
            '        journal["entries"].append(entry)\n        state.save(journal)\n        try:\n',
            '        journal["entries"].append(entry)\n        try:\n', "JournalDurabilityTest"),
    overlay("revert-begun-not-journaled",
            '    journal["reverting"] = True\n    state.save(journal)\n',
            '    journal["reverting"] = True\n', "JournalDurabilityTest"),
    # overlay_setup.py: revert exactness
    overlay("restored-file-keeps-a-new-mtime",
            '    if meta.get("mtime_ns") is not None:\n'
            '        os.utime(fd, ns=(meta["atime_ns"], meta["mtime_ns"]))\n', "",
            "RevertExactnessTest"),
    overlay("directory-mtimes-not-restored",
            "for directory, mtime_ns in sorted(self.dirs.items(), reverse=True):",
            "for directory, mtime_ns in []:", "RevertExactnessTest"),
    overlay("killed-build-moves-uncopied-rewrites-aside",
            '        products = [product for product in products if product["created"]]\n', "",
            "RevertExactnessTest"),
    overlay("revert-removes-a-directory-it-did-not-create",
            'if product["kind"] == "d" and product["created"] and os.path.isdir(product["path"]):',
            'if product["kind"] == "d" and os.path.isdir(product["path"]):',
            "RevertExactnessTest"),
    overlay("created-products-left-behind", "remove_products(products, aside)", "pass",
            "CProjectTest"),
    overlay("entries-reverted-oldest-first",
            "for entry in reversed(native_entries(state, journal)):",
            "for entry in native_entries(state, journal):", "CProjectTest",
            "TwoOverlaysTest"),
    overlay("hard-linked-source-comes-back-as-a-copy",
            "put_file(path, record, source=backup, link_ok=same_fs)",
            "put_file(path, record, source=backup, link_ok=False)", "InstallFileSafetyTest"),
    overlay("hard-linked-artifact-comes-back-as-a-copy",
            '    if record.get("inode_backup"):\n        restore_inode(state, record)\n        return\n',
            "", "ComeBackTest"),
    overlay("source-edited-after-apply-is-reverted-over",
            "            if changed:  # --force on the older of two overlays",
            "            if False:  # --force on the older of two overlays",
            "CProjectTest", "TwoOverlaysTest"),
    overlay("artifact-rebuilt-by-another-is-reverted-over",
            "        changed = rebuilt_since_apply(state, [entry.record for entry in entries])\n"
            "        if changed:\n",
            "        changed = rebuilt_since_apply(state, [entry.record for entry in entries])\n"
            "        if False:\n",
            "CProjectTest"),
    overlay("file-edited-after-the-build-is-restored",
            "if not unchanged_since_build(record)\n", "if False\n", "PreExistingFileTest",
            "OwnedFilesTest"),
    overlay("build-that-changed-no-artifact-passes", "        if noop:\n", "        if False:\n",
            "CProjectTest"),
    overlay("gc-stale-not-exact-exits-0",
            '        return 1\n    return NOT_EXACT if not_exact else 0\n\n\n# ----------------'
            '------------------------------------------------ trial\n',
            '        return 1\n    return 0\n\n\n# ----------------'
            '------------------------------------------------ trial\n', "RevertExactnessTest"),
    overlay("revert-not-exact-exits-0", "        report_inexact(state, inexact)\n        return NOT_EXACT\n",
            "        report_inexact(state, inexact)\n        return 0\n", "PreExistingFileTest"),
    # overlay_setup.py: dry run
    overlay("dry-run-makes-the-state-directory",
            '        """Check the plan as the real run would and print it; change nothing."""\n'
            "        state = self.state\n",
            '        """Check the plan as the real run would and print it; change nothing."""\n'
            "        state = self.state\n        os.makedirs(state.root, exist_ok=True)\n",
            "PlanRunsNothingTest"),
    # check_contract.py: the build-script reader
    checker("set-keeps-the-double-dash-as-first-parameter",
            "self.args, self.origin = list(words), None",
            'self.args, self.origin = ["--"] + list(words), None',
            "PositionalParametersTest"),
    checker("shift-moves-nothing", "        self.args = self.args[count:]\n", "",
            "ScriptReaderTest"),
    checker("bare-env-shebang-accepted",
            ' or (words[0] == "/usr/bin/env"\n                                                              and len(words) < 2)', "",
            "ShebangTest"),
    checker("library-outside-the-output-dir-accepted",
            '        else:\n            backend.error("B013", "%sbuild script %s writes its library to %s, '
            'not under its "',
            '        elif False:\n            backend.error("B013", "%sbuild script %s writes its '
            'library to %s, not under its "', "BuildScriptTest"),
    # check_contract.py: ABI
    checker("abi-version-mismatch-accepted",
            "elif backend.abi_version is not None and literal[0][3] != backend.abi_version:",
            "elif False:", "AbiTest", "TextOutputTest"),
    checker("several-abi-versions-accepted", "    if len(values) > 1:\n", "    if len(values) > 2:\n",
            "AbiTest", "AbiReadingTest"),
    # check_contract.py: targets
    checker("fatbin-arch-specific-suffix-dropped",
            'suffix = "a" if flags & FATBIN_ARCH_SPECIFIC else ', "suffix = ",
            "FatbinReaderTest"),
    checker("fatbin-next-container-not-aligned",
            "pos = (pos + header_size + size + 7) & ~7", "pos = pos + header_size + size",
            "FatbinReaderTest"),
    checker("ptx-read-as-sass", 'ptx.add("%d%s" % (target, suffix))', 'sass.add("%d%s" % (target, suffix))',
            "FatbinReaderTest"),
    checker("old-rocm-bundle-ids-not-read",
            'HIP_BUNDLE_ID_RE = re.compile(r"hip(?:v4)?-amdgcn', 'HIP_BUNDLE_ID_RE = re.compile(r"hipv4-amdgcn',
            "HipBundleReaderTest"),
    checker("library-targets-not-compared", "    if found != expected:\n        report(\"error\", \"R008\"",
            "    if False:\n        report(\"error\", \"R008\"", "CudaBuildTierTest", "HipBuildTierTest"),
    # check_contract.py: discovery
    checker("stray-manifest-not-reported", "elif child.name.endswith(MANIFEST_SUFFIX):",
            "elif False:", "DiscoveryTest", "DiscoveryHolesTest"),
    checker("stray-kernel-source-not-reported", "elif is_kernel_source(child.name):", "elif False:",
            "WalkTest"),
    checker("undeclared-source-is-a-warning", 'backend.error("S004", "kernel source %s is not declared',
            'backend.warning("S004", "kernel source %s is not declared', "SourcesTest",
            "TextOutputTest"),
    checker("missing-required-key-accepted", "            if required:\n                backend.error(\"M001\"",
            "            if False:\n                backend.error(\"M001\"", "KeysTest", "ManifestFileTest"),
    # check_contract.py: exit statuses
    checker("strict-ignores-warnings", 'if run.count("error") or (args.strict and run.count("warning")):',
            'if run.count("error"):', "CommandLineTest", "DiscoveryTest"),
    checker("usage-error-exits-1",
            '        sys.stderr.write("check_contract.py: error: %s\\n" % escape_control(str(exc)))\n'
            "        return 2\n",
            '        sys.stderr.write("check_contract.py: error: %s\\n" % escape_control(str(exc)))\n'
            "        return 1\n", "CommandLineTest", "RootTest"),
    checker("closed-stdout-exits-1",
            '                             "report is incomplete\\n" % exc)\n        except OSError:  # stderr went with it\n'
            "            pass\n        return 2\n",
            '                             "report is incomplete\\n" % exc)\n        except OSError:  # stderr went with it\n'
            "            pass\n        return 1\n", "NoTracebackTest"),
    # check_contract.py: output formats
    checker("github-percent-escaped-last",
            'text = text.replace("%", "%25").replace("\\r", "%0D").replace("\\n", "%0A")',
            'text = text.replace("\\r", "%0D").replace("\\n", "%0A").replace("%", "%25")',
            "AnnotationEscapingTest"),
    checker("github-property-colon-and-comma-not-escaped",
            'text = text.replace(":", "%3A").replace(",", "%2C")', "text = text",
            "AnnotationEscapingTest"),
    checker("github-annotation-without-its-line", '            fields.append("line=%d" % d.line)\n',
            "            pass\n", "ReportOrderTest"),
    checker("findings-not-sorted", "found = sorted(diagnostics, key=Diagnostic.sort_key)",
            "found = list(diagnostics)", "ReportOrderTest"),
    checker("findings-sorted-without-their-line",
            'return (self.backend, self.path or "", self.line or 0, self.code, self.message)',
            'return (self.backend, self.path or "", self.code, self.message)', "ReportOrderTest"),
    checker("github-warning-shown-as-error", 'return "::%s %s::%s\\n" % (d.level,',
            'return "::%s %s::%s\\n" % ("error",', "ReportOrderTest"),
    checker("sarif-warning-shown-as-error", 'result = {"ruleId": d.code, "level": d.level,',
            'result = {"ruleId": d.code, "level": "error",', "ReportOrderTest"),
    checker("sarif-drops-suppressed-findings", "    for d in run.diagnostics + run.suppressed:\n"
            '        result = {"ruleId"', "    for d in run.diagnostics:\n        result = {\"ruleId\"",
            "FormatsTest"),
    checker("json-counts-warnings-as-errors", '"errors": run.count("error"), "warnings"',
            '"errors": len(run.diagnostics), "warnings"', "ReportOrderTest"),
    checker("text-control-characters-not-escaped", "    return escape_control(text) + \"\\n\"\n",
            "    return text + \"\\n\"\n", "TextOutputTest"),
    checker("text-path-not-relative-to-the-current-directory",
            'if full.startswith(self.cwd.rstrip("/") + "/"):', "if False:", "TextOutputTest"),
    checker("summary-does-not-count-suppressed",
            'return ", %d suppressed (--format json lists them)" % len(suppressed) if suppressed else ""',
            'return ""', "SuppressionTest"),
]
# Tried and left out as equivalent: the utime after a renamed cache comes
# back (on ext4 and tmpfs a rename keeps a directory's mtime), and a
# hard-linked source backed up as a copy instead of by its inode (the copy
# keeps the inode too, as an artifact's does, so revert gives it back).


def check_patterns(mutants: List[Mutant]) -> List[str]:
    """One line per mutant whose pattern does not occur exactly once, or
    whose edit leaves a file Python cannot compile."""
    problems = []
    texts = {}
    for mutant in mutants:
        if mutant.file not in texts:
            with open(os.path.join(ROOT, mutant.file), encoding="utf-8") as handle:
                texts[mutant.file] = handle.read()
        count = texts[mutant.file].count(mutant.pattern)
        if count != 1:
            problems.append("mutant %s: its pattern occurs %d times in %s, not once; edit it to "
                            "break the same promise in the code as it is now"
                            % (mutant.name, count, mutant.file))
            continue
        try:  # a mutant that does not compile would be killed by any test, proving nothing
            compile(texts[mutant.file].replace(mutant.pattern, mutant.replacement), mutant.file,
                    "exec")
        except SyntaxError as exc:
            problems.append("mutant %s: %s no longer compiles with it (line %s: %s)"
                            % (mutant.name, mutant.file, exc.lineno, exc.msg))
    return problems


def run_classes(copy: str, classes: tuple, timeout: float) -> tuple:
    """(passed, seconds, the last lines of output) of the classes in `copy`."""
    started = time.monotonic()
    try:
        done = subprocess.run([sys.executable, "-m", "unittest", "-f"] + list(classes), cwd=copy,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              universal_newlines=True, timeout=timeout,
                              env=dict(os.environ, PYTHONDONTWRITEBYTECODE="1"))
    except subprocess.TimeoutExpired:
        return False, time.monotonic() - started, "timed out after %d s" % timeout
    return done.returncode == 0, time.monotonic() - started, done.stdout[-2000:]


def copy_repository(target: str) -> None:
    shutil.copytree(ROOT, target, symlinks=True,
                    ignore=shutil.ignore_patterns(".git", "__pycache__"))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("names", nargs="*", metavar="NAME", help="run only these mutants")
    parser.add_argument("--list", action="store_true", help="list the mutants and exit")
    parser.add_argument("--timeout", type=float, default=1200,
                        help="seconds one mutant's tests may run; past it the mutant is killed "
                             "(default 1200)")
    args = parser.parse_args(argv)
    names = [m.name for m in MUTANTS]
    duplicates = sorted({n for n in names if names.count(n) > 1})
    if duplicates:
        print("mutation.py: mutant names used twice: %s" % ", ".join(duplicates), file=sys.stderr)
        return 2
    unknown = [n for n in args.names if n not in names]
    if unknown:
        print("mutation.py: no mutant named %s; --list shows them" % ", ".join(unknown),
              file=sys.stderr)
        return 2
    chosen = [m for m in MUTANTS if not args.names or m.name in args.names]
    if args.list:
        for mutant in chosen:
            print("%s  %s  %s" % (mutant.name, mutant.file, " ".join(mutant.classes)))
        return 0
    problems = check_patterns(chosen)
    if problems:
        print("\n".join(problems), file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory(prefix="mutation-") as temp:
        os.chmod(temp, 0o755)  # the tests that run the tools as another user read them there
        copy = os.path.join(temp, "repo")
        copy_repository(copy)
        classes = tuple(sorted({c for m in chosen for c in m.classes}))
        passed, seconds, output = run_classes(copy, classes, args.timeout * len(classes))
        if not passed:
            print("%s\nmutation.py: the tests fail with no mutant (%.0f s), so no mutant can be "
                  "judged; fix them first" % (output, seconds), file=sys.stderr)
            return 2
        print("unmutated: %d class(es) pass (%.0f s)" % (len(classes), seconds), flush=True)
        survivors = []
        for mutant in chosen:
            path = os.path.join(copy, mutant.file)
            with open(path, encoding="utf-8") as handle:
                original = handle.read()
            with open(path, "w", encoding="utf-8") as handle:
                handle.write(original.replace(mutant.pattern, mutant.replacement))
            try:
                passed, seconds, _ = run_classes(copy, mutant.classes, args.timeout)
            finally:
                with open(path, "w", encoding="utf-8") as handle:
                    handle.write(original)
            if passed:
                survivors.append(mutant.name)
            print("%-8s %s (%.0f s)" % ("SURVIVED" if passed else "killed", mutant.name, seconds),
                  flush=True)
    killed = len(chosen) - len(survivors)
    print("killed %d of %d mutants (%.0f%%)%s" % (
        killed, len(chosen), 100.0 * killed / len(chosen),
        "; survived: %s" % ", ".join(survivors) if survivors else ""))
    return 1 if survivors else 0


if __name__ == "__main__":
    sys.exit(main())
