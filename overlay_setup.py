#!/usr/bin/env python3
"""overlay_setup.py: try a patched kernel inside a real install, then take it back out.

One tool, one journal, one revert for two kinds of change:

* native: a compiled source (.cu .cuh .hip .cpp .cc .cxx .c .h .hpp) is patched
  in place inside an installed package, the install's own build command rebuilds
  it incrementally, and `revert` gives back sources, artifacts and caches
  byte-exact (content, mode, mtime; "absent" means removed);
* Python: a module is shadowed (or an attribute rebound) for every Python
  process started with the overlay's PYTHONPATH, through a generated
  `sitecustomize.py` that chains to any other `sitecustomize` further along
  the path.

Promise: every mutation of the install is preceded by a durable journal record
and durable backups (fsync, write-new-then-rename, fsync of the directory).  A
run killed at any point leaves a state from which `revert` or `gc-stale`
restores the tree byte-exact.  `revert` and `gc-stale` never run a command
taken from the journal.

Usage:
  overlay_setup.py [--state DIR] init [--owner-pid PID]
  overlay_setup.py [--state DIR] add-python MODULE FILE [--owner-pid PID]
  overlay_setup.py [--state DIR] rebind pkg.mod:attr other.mod:attr [--owner-pid PID]
  overlay_setup.py [--state DIR] env [--format text|json] [--json]
  overlay_setup.py [--state DIR] add-native --source PATH --patched FILE
        [--artifact PATH]... [--invalidate-cache DIR]...
        (--build-cmd CMD | --no-build) [--build-cwd DIR] [--build-dir DIR]...
        [--timeout S] [--owner-pid PID] [--protect PATH]... [--no-protect] [--dry-run]
  overlay_setup.py [--state DIR] apply PATCH [--root DIR] [-p N] [--artifact PATH]...
        [--invalidate-cache DIR]... (--build-cmd CMD | --no-build)
        [--build-cwd DIR] [--build-dir DIR]... [--timeout S] [--owner-pid PID]
        [--protect PATH]... [--no-protect] [--dry-run]
  overlay_setup.py [--state DIR] update [PATCH [--root DIR] [-p N] | --patched FILE]
        [--entry N] [--timeout S] [--owner-pid PID]
  overlay_setup.py [--state DIR] trial PATCH [apply's options] [--repeat N] [--json]
        -- COMMAND [ARG...]
  overlay_setup.py [--state DIR] verify-native
  overlay_setup.py [--state DIR] status [--format text|json] [--json]
  overlay_setup.py [--state DIR] revert [--force] [--keep-untracked] [--all]
  overlay_setup.py gc-stale [--root DIR] [--dry-run]

  Before the build, the existing files it may rewrite are backed up too, so
  that revert gives back the install's build state as well: for make the
  targets `make -n --trace -W SOURCE` names, for ninja and `cmake --build` the
  outputs depending on the source in ninja's graph plus .ninja_log and
  .ninja_deps, for any other build the object files, libraries and depfiles
  of the build directory and everything under its build/ folder (over 1 GiB
  is refused: --no-protect, --protect PATH).  make is asked only once the
  entry is journaled (make -n evaluates the Makefile's $(shell ...)), ninja
  in a copy of its logs (every ninja run rewrites them).  --dry-run prints
  the plan and runs nothing of the install: it does not ask make.  The
  other small files already in the build directory (a _version.py, a
  config) are copied as well before each build, up to 256 KiB each, 500
  files and 16 MiB in all; the copies of those the build left alone are
  dropped after it, and revert puts the others back while each is still
  what the build left (a file over the budget is named: E506).

  --state may come before or after the subcommand; default $OVERLAY_STATE,
  else the current directory's own state directory outside every install,
  $XDG_STATE_HOME/overlay_setup/<its path>-<hash> (XDG_STATE_HOME unset or
  relative: ~/.local/state), so every command run from the same directory
  finds the overlay with no option.  Relative paths are taken from the current
  directory and recorded absolute.  That folder's listing is the registry of
  applied overlays (a state directory elsewhere has a record in its applied/
  folder, written before the first change and removed after a full revert):
  `status` without a state here lists them, the other commands name the exact
  command for each, `revert --all` reverts them all, `gc-stale` looks at them
  as well as under --root.

  The owner (--owner-pid, default: the leader of this process's session: the
  login or terminal shell, or the program that started the commands) is
  recorded with its start time, host, pid namespace and boot so that gc-stale
  tells a completed overlay whose owner is gone from a live one, also after
  the pid was reused; an owner in another pid namespace or on another host
  cannot be checked, and is never taken for gone.
  An entry that a run of the tool was applying, building, updating or
  reverting when it died is stale whoever the owner is.  The session outlives
  `timeout`, make recipes and a fresh shell per command; `sudo` and `setsid`
  start a session of their own, so the session of what started them is taken.

Exit codes:
  0  done (also: revert with nothing to revert)
  1  failed; the message says what to run next
  2  usage: a wrong option, a path whose '..' leaves a symlink, a bad module name,
     a missing input file or directory
  3  revert or gc-stale finished, but the files named are not back
     byte-exact: the build rewrote or deleted them and nothing had backed
     them up (E506: a build product nothing predicted, a file over the
     budget of copies), or they changed after the build and were kept (E510)
  10-14  trial: the step that failed (the install is reverted first):
     10 the reference run, 11 apply or its build, 12 the verification,
     13 the candidate run, 14 the revert (or the install differs from before)
  130  interrupted (Ctrl-C), also while the tool starts; add-native, apply and
       trial revert what they applied first (a second Ctrl-C stops that)
     (143 for SIGTERM)

Failures are one line on stderr: `overlay_setup: CODE what is wrong; what to do`
(warnings start with `warning: `; gc-stale and revert --all end with a count
of the state directories they could not handle).
Codes (stable, never reused; docs/overlay_setup.md says what each means and
how to fix it):
  E1xx  arguments and preconditions
        E100 command line not understood, E101 path going up from a symlink,
        E102 input missing or unreadable, E103 already overlaid, E104 not a
        regular file (symlink, directory), E105 bad module name, E106
        overlapping paths, E107 missing directory, E108 owner pid not
        running, E109 missing or bad build option (--timeout, -p), E110 the build
        products to back up are over the size budget, or the build
        directory is too large to scan whole, E111 a .py file the
        interpreter does not import from that file, E120 a path
        another applied overlay holds, E121 state directory inside the build
        directory, E122 a file of a cache to snapshot has hard links outside it,
        E123 a build command whose build directories only the shell knows
        E124 a source or artifact another user's or state directory's overlay holds
  E2xx  the state directory and its journal
        E201 newer journal format, E202 journal unreadable, damaged or
        missing, E203 journal names a path outside its bounds, E204 state
        directory not yours or writable by others, E205 another owner,
        E206 state path is not an overlay state directory, E207 no overlay yet,
        E208 no overlay here but applied ones elsewhere, E209 a registered
        state directory whose journal is gone, E210 the state directory
        cannot be written, E211 update of an entry whose run stopped
        before its build finished, E212 the state home would be made in
        another user's directory, E213 a Python overlay in a state path
        holding ':'
  E3xx  patches
        E301 malformed, E302 hunk does not apply, E303 unsupported file
        kind, E304 path leaves --root, E305 rename, copy or binary patch
  E4xx  builds and verification
        E401 build failed, E402 build timed out, E403 artifact not rebuilt
        or missing, E404 the build changed no artifact, E405 nothing to verify,
        E406 the build deleted the state directory
  E5xx  revert and recovery
        E501 source changed after apply, E502 unsafe or unreadable cache
        snapshot, E503 backup missing, E504 a directory stands where a file
        is restored or removed, E505 a path changed since it was recorded
        (a symlink in the way), E506 not byte-exact: the build rewrote or
        deleted a file nothing backed up (over the budget of copies, or
        a build product nothing predicted; exit status 3), E509 an artifact
        or cache changed since the overlay's build, E510 a build product
        changed since the overlay's build, kept (exit status 3)
  E6xx  I/O errors during a change
        E601 could not write or read (no space, permission); the state
        stays recoverable

Test hooks (for the crash and I/O-error tests only; never set them in use):
  OVERLAY_TEST_KILL_AT=N    the process kills itself with SIGKILL just before
                            its N-th mutation (1-based) of the install or state
                            (N,M,...: before each of them, for a signal it catches).
  OVERLAY_TEST_KILL_SIGNAL=S  ... with SIGS (TERM, HUP) instead of SIGKILL.
  OVERLAY_TEST_ENOSPC_AT=N  the N-th data write fails with OSError(ENOSPC).
"""


import os
import _signal  # the C module: `signal` itself takes milliseconds to load


def _interrupted_at_start_up(signum: int, frame: object) -> None:
    os._exit(130)


if __name__ == "__main__" and _signal.getsignal(_signal.SIGINT) is _signal.default_int_handler:
    # Ctrl-C while the modules below load ends the run as any interrupt does
    # (status 130), not with a traceback; main() puts the usual handler back.
    _signal.signal(_signal.SIGINT, _interrupted_at_start_up)

import argparse
import collections
import contextlib
import csv
import errno
import fcntl
import hashlib
import json
import math
import pwd
import re
import selectors
import shlex
import shutil
import signal
import stat
import subprocess
import sys
import tarfile
import tempfile
import threading
import time
from typing import Callable, Dict, Iterator, List, Optional, Tuple

VERSION = "1.0.0"
FORMAT_VERSION = 1
TOOL_NAME = "overlay_setup"
JOURNAL_NAME = "journal.json"  # in the state directory
RESERVE_NAME = "reserve"  # in the state directory while an entry is applied
RESERVE_SIZE = 1 << 20  # bytes held for the journal at least (reserve_space)
OLD_JOURNAL_NAME = "manifest.json"  # version 1.0's name for it, still read
NATIVE_SUFFIXES = (".cu", ".cuh", ".hip", ".cpp", ".cc", ".cxx", ".c", ".h", ".hpp")
# Build descriptions a patch may tune (flags, architectures), patched in place
# like a source; build.ninja is not among them: the build system writes it.
BUILD_FILE_NAMES = ("Makefile", "makefile", "GNUmakefile", "CMakeLists.txt", "setup.py",
                    "pyproject.toml")
BUILD_FILE_SUFFIXES = (".mk", ".cmake")
SCAN_LIMIT = 50000
CHUNK = 1 << 20
HOLE_UNIT = 4096  # a run of zeros this long, at this alignment, is restored as a hole
ZEROS = bytes(HOLE_UNIT)
INPUT_LIMIT = 64 << 20  # a patch or a patched source, read whole into memory
MODULE_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*$")
GIT_HEADER_RE = re.compile(r"^(new file mode|deleted file mode|old mode|new mode) (\d+)$")
GIT_MODES = {"100644": 0o644, "100755": 0o755}
GIT_MODE_KINDS = {"120000": "a symlink", "160000": "a submodule"}
HUNK_RE = re.compile(r"^@@ -(\d+)(?:,(\d+))? \+(\d+)(?:,(\d+))? @@")
LINE_RE = re.compile(r"[^\n]*\n|[^\n]+$")
MTIME_KEY = "OVERLAY.mtime_ns"
XATTR_KEY = "OVERLAY.xattr."  # + the attribute's name; its value hex-encoded
OUTPUT_LINE_END_RE = re.compile(rb"\r\n|\r|\n")
OUTPUT_LINE_LIMIT = 1 << 16  # a longer line of build output is shown in pieces
OUTPUT_POLL = 0.2  # seconds between looks at whether the build process exited
OUTPUT_QUIET = 1.0  # a partial line is shown after the build was silent this long
OUTPUT_GRACE = 2.0  # seconds the output is still read after the build process exited
LINGER_LIMIT = 10.0  # seconds the build's group is waited for after its shell exited
# Object files, libraries, depfiles and GPU code objects a build may rewrite.
VCS_FOLDERS = (".git", ".hg", ".svn")
BUILD_TOOLS = ("make", "gmake", "ninja", "ninja-build", "cmake")  # whose plans can be asked
# Words that run the command after them where they run: their options that
# take a value, and how many operands come before the command.
WRAPPERS = {"nice": ({"-n", "--adjustment"}, 0), "nohup": (set(), 0), "command": (set(), 0),
            "time": ({"-f", "--format", "-o", "--output"}, 0), "exec": (set(), 0),
            "stdbuf": ({"-i", "-o", "-e"}, 0), "env": ({"-u", "--unset"}, 0),
            "timeout": ({"-s", "--signal", "-k", "--kill-after"}, 1),
            "ionice": ({"-c", "-n", "-p"}, 0), "taskset": (set(), 1), "sudo": ({"-u", "-g"}, 0)}
SUBSTITUTION = "$SUBSTITUTION"  # what shell_words puts for a $(...) or `...`
SHELL_KEYWORDS = ("{", "}", "!", "if", "then", "else", "elif", "fi", "do", "done", "while", "until")
LOADABLE_RE = re.compile(r"\.(so(\.[0-9]+)*|cubin|fatbin|hsaco)$")  # what a JIT loads
PRODUCT_RE = re.compile(r"\.(o|obj|a|so|dylib|dll|pyd|lib|exp|d|ptx|cubin|fatbin)(\.[0-9]+)*$")
PROTECT_BUDGET = 1 << 30  # bytes of existing build products backed up without being asked
# Before each build, the small pre-existing files of the build directory that
# are no build product (a version file, a config, a generated module) are
# copied too, and after it the copies of those it left alone are dropped.  A
# version file is some hundred bytes; each copy is fsynced (about 4 ms on
# ext4), so 500 of them add about 2 s to a build in a large tree.
ORIGINAL = "pre-existing file"  # the role of such a copy in the journal
DISTRIBUTION_WHY = "installed with %s"  # why a file of an artifact's distribution is kept
ORIGINAL_FILE_LIMIT = 256 << 10  # bytes: a larger file is not copied
ORIGINAL_BUDGET = 16 << 20  # bytes copied before one build, at most
ORIGINAL_COUNT = 500  # files copied before one build, at most
CMAKE_DEPEND_STATE = ("compiler_depend.make", "compiler_depend.internal", "compiler_depend.ts",
                      "depend.make", "depend.internal")
DEPFILE_LIMIT = 1 << 20  # bytes: a compiler depfile is far smaller
PREDICT_TIMEOUT = 120  # seconds for one dry-run query of make or ninja
NOT_EXACT = 3  # exit status: reverted, but some files are not back byte-exact
FICLONE = 0x40049409  # Linux ioctl: share the extents of another file (reflink)


# ---------------------------------------------------------------- errors


class OverlayError(Exception):
    """A failure the user can act on: one line, a stable code, exit status 1."""

    status = 1

    def __init__(self, code: str, message: str):
        super().__init__(message)
        self.code = code
        self.message = message


class UsageError(OverlayError):
    status = 2


class RolledBack(KeyboardInterrupt):
    """Ctrl-C stopped a command, which took back what it had applied."""


class Stopped(BaseException):
    """SIGTERM or SIGHUP arrived during a build: unwind as Ctrl-C does, so
    that the build's process group is stopped with this process."""

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum


# ---------------------------------------------------------------- fault hooks


_FAULTS = {"points": 0, "writes": 0, "target": None}


def mutation_point() -> None:
    """Count one mutation; the kill hook fires just before the chosen one."""
    _FAULTS["points"] += 1
    kill_at = os.environ.get("OVERLAY_TEST_KILL_AT")
    if kill_at and str(_FAULTS["points"]) in kill_at.split(","):
        sys.stdout.flush()
        sys.stderr.flush()
        os.kill(os.getpid(), getattr(signal, "SIG" + os.environ.get("OVERLAY_TEST_KILL_SIGNAL",
                                                                    "KILL")))


def write_point(path: str) -> None:
    _FAULTS["writes"] += 1
    _FAULTS["target"] = path
    fail_at = os.environ.get("OVERLAY_TEST_ENOSPC_AT")
    if fail_at and int(fail_at) == _FAULTS["writes"]:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), path)


# ---------------------------------------------------------------- durable file operations


def fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


TEMP_PREFIX = ".overlay-tmp-"
CLAIM_LIMIT = 4096  # bytes of a claim file read


def temp_beside(path: str, kind: str = "") -> str:
    """The temporary name a new version of `path` is written under: short and
    fixed whatever the length of the name (a 255-byte name has no room for a
    suffix), so that the next run finds and removes one left by a crash."""
    head, tail = os.path.split(path)
    digest = hashlib.sha256(os.fsencode(tail) + os.fsencode(kind)).hexdigest()[:16]
    return os.path.join(head, TEMP_PREFIX + digest)


def _open_new(path: str, mode: int) -> int:
    if os.path.lexists(path):
        os.unlink(path)
    return os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, mode)


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


def durable_write(path: str, data: bytes, mode: int = 0o600) -> None:
    """Write a file of the state directory (or the registry) as a new file
    renamed into place, all fsynced.  The temporary name is this process's
    own: two first uses of one state directory write the same registry
    record at once."""
    mutation_point()
    write_point(path)
    tmp = temp_beside(path, "pid%d" % os.getpid())
    fd = _open_new(tmp, 0o600)
    try:
        _write_all(fd, data)
        os.fchmod(fd, mode)
        os.fsync(fd)
    except BaseException:
        os.close(fd)
        os.unlink(tmp)
        raise
    os.close(fd)
    os.replace(tmp, path)
    fsync_dir(os.path.dirname(path))


def copy_sparse(source: str, fd: int) -> None:
    """Copy a file's content into the empty file `fd`, in the kernel: as a
    reflink where the filesystem shares extents, else data segment by data
    segment (SEEK_DATA/SEEK_HOLE), so that holes stay holes and a sparse 1 GB
    file costs its data, not 1 GB."""
    try:
        src = os.open(source, os.O_RDONLY | os.O_NOFOLLOW)
    except OSError as exc:
        raise read_failure(exc, source)
    try:
        try:
            fcntl.ioctl(fd, FICLONE, src)
            return
        except OSError:
            pass
        size = os.fstat(src).st_size
        offset = 0
        while offset < size:
            try:
                start = os.lseek(src, offset, os.SEEK_DATA)
                end = os.lseek(src, start, os.SEEK_HOLE)
            except OSError as exc:
                if exc.errno == errno.ENXIO:  # only a hole is left
                    break
                if exc.errno != errno.EINVAL:  # EINVAL: no hole support, copy it all
                    raise
                start, end = offset, size
            os.lseek(fd, start, os.SEEK_SET)
            while start < end:
                sent = os.sendfile(fd, src, start, min(end - start, 1 << 30))
                if sent == 0:
                    raise OSError(errno.EIO, "%s shrank while it was copied" % source, source)
                start += sent
            offset = end
        os.ftruncate(fd, size)
    finally:
        os.close(src)


BACKUP_MODE_MASK = ~(stat.S_ISUID | stat.S_ISGID | stat.S_IXOTH)


def durable_copy(source: str, target: str) -> str:
    """Back up a regular file: a sparse copy with its times, without set-id
    bits or execute-for-others (a backup of a setuid binary must not be one);
    fsynced.  Returns its sha256: the kernel copies while a thread hashes, so
    a large artifact costs about one copy.  The caller fsyncs the directory
    once.  The journal keeps the owner, the whole mode and the extended
    attributes for the restore."""
    mutation_point()
    write_point(target)
    st = os.stat(source, follow_symlinks=False)
    digest: List[object] = []

    def hash_source() -> None:
        try:
            digest.append(file_sha256(source))
        except OSError as exc:
            digest.append(exc)

    hasher = threading.Thread(target=hash_source)
    hasher.start()
    try:
        fd = _open_new(target, 0o600)
        try:
            copy_sparse(source, fd)
            os.fchmod(fd, stat.S_IMODE(st.st_mode) & BACKUP_MODE_MASK)
            os.utime(fd, ns=(st.st_atime_ns, st.st_mtime_ns))
            os.fsync(fd)
        finally:
            os.close(fd)
    finally:
        hasher.join()
    if isinstance(digest[0], OSError):
        raise digest[0]
    return digest[0]


def folder_identity(path: str) -> Optional[list]:
    """(device, inode) of the folder holding `path`; None when there is none."""
    try:
        st = os.lstat(os.path.dirname(path))
    except (FileNotFoundError, NotADirectoryError):
        return None
    return [st.st_dev, st.st_ino] if stat.S_ISDIR(st.st_mode) else None


def file_identity(path: str) -> list:
    """What changes whenever a file's content is rewritten (ctime included)."""
    st = os.lstat(path)
    return [st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns]


def durable_rename(source: str, target: str) -> None:
    mutation_point()
    os.rename(source, target)
    fsync_dir(os.path.dirname(source))
    if os.path.dirname(source) != os.path.dirname(target):
        fsync_dir(os.path.dirname(target))


def remove_path(path: str) -> None:
    """Remove a file, symlink or directory tree without following symlinks."""
    if not os.path.lexists(path):
        return
    mutation_point()
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path)
    else:
        os.unlink(path)
    fsync_dir(os.path.dirname(path))


def makedirs_durable(path: str, mode: int = 0o755) -> None:
    """Create a directory and its missing parents; one created meanwhile by
    another process (two first uses of one state directory) is no error."""
    if os.path.isdir(path):
        return
    parent = os.path.dirname(path)
    makedirs_durable(parent)
    mutation_point()
    try:
        os.mkdir(path, mode)
    except FileExistsError:
        if not os.path.isdir(path):
            raise
    fsync_dir(parent)


# ---------------------------------------------------------------- the install's files, without following symlinks
#
# Everything revert writes into the install goes through these: the directory
# of a file is reached from / one component at a time with O_NOFOLLOW, so a
# directory that was replaced by a symlink after the apply (build/ -> victim/)
# is refused, never written through; the file itself is replaced by a rename
# within that directory.

DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW
KEPT_XATTRS = ("system.posix_acl_access", "security.capability")  # and every user.*


def path_changed(path: str, component: str, now: str) -> OverlayError:
    return OverlayError("E505", "%s is no longer what the journal recorded: %s is now %s; nothing "
                        "was written through it: put the directory back (or move it away), then "
                        "run revert again" % (path, component, now))


def symlink_on_the_way(path: str) -> Optional[str]:
    """The first directory above `path` that is a symlink (or no directory), or None."""
    current = ""
    for part in [part for part in os.path.dirname(path).split("/") if part]:
        current += "/" + part
        try:
            st = os.lstat(current)
        except FileNotFoundError:
            return None
        if not stat.S_ISDIR(st.st_mode):
            return current
    return None


def open_parent(path: str, create: bool = False) -> int:
    """A descriptor of the directory holding `path`, reached without following
    a symlink (E505 when a component is one, or no directory).  With
    `create`, directories the build removed are made again; else a missing
    one raises FileNotFoundError."""
    fd = os.open("/", DIR_FLAGS)
    walked = ""
    try:
        for part in [part for part in os.path.dirname(path).split("/") if part]:
            walked += "/" + part
            try:
                child = os.open(part, DIR_FLAGS, dir_fd=fd)
            except FileNotFoundError:
                if not create:
                    raise
                mutation_point()
                try:
                    os.mkdir(part, 0o755, dir_fd=fd)
                except FileExistsError:
                    pass
                os.fsync(fd)
                child = os.open(part, DIR_FLAGS, dir_fd=fd)
            except OSError as exc:
                if exc.errno not in (errno.ELOOP, errno.ENOTDIR):
                    raise
                st = os.stat(part, dir_fd=fd, follow_symlinks=False)
                raise path_changed(path, walked, "a symlink" if stat.S_ISLNK(st.st_mode)
                                   else "no directory")
            os.close(fd)
            fd = child
    except BaseException:
        os.close(fd)
        raise
    return fd


def read_xattrs(path: str) -> Dict[str, str]:
    """The extended attributes a revert gives back (user.*, the POSIX ACL,
    file capabilities), hex-encoded for the journal."""
    try:
        names = os.listxattr(path, follow_symlinks=False)
    except OSError as exc:
        if exc.errno in (errno.ENOTSUP, errno.EOPNOTSUPP):
            return {}
        raise
    return {name: os.getxattr(path, name, follow_symlinks=False).hex() for name in sorted(names)
            if name.startswith("user.") or name in KEPT_XATTRS}


def set_metadata(fd: int, meta: dict) -> None:
    """Give an open file the recorded owner, then mode (chown clears set-id
    bits), then extended attributes (chown clears a capability; an ACL
    refines the mode), then times."""
    if os.geteuid() == 0 and meta.get("uid") is not None:
        os.fchown(fd, meta["uid"], meta["gid"])
    os.fchmod(fd, meta["mode"])
    wanted = meta.get("xattrs") or {}
    if wanted or os.listxattr(fd):
        for name in os.listxattr(fd):
            if (name.startswith("user.") or name in KEPT_XATTRS) and name not in wanted:
                os.removexattr(fd, name)
        for name, value in sorted(wanted.items()):
            os.setxattr(fd, name, bytes.fromhex(value))
    if meta.get("mtime_ns") is not None:
        os.utime(fd, ns=(meta["atime_ns"], meta["mtime_ns"]))


def put_file(target: str, meta: dict, data: Optional[bytes] = None,
             source: Optional[str] = None, link_ok: bool = False,
             sync_directory: bool = True) -> None:
    """Put a new version of `target` in place: made under a short temporary
    name beside it (`data` written, or `source` copied sparse, or with
    `link_ok` hard-linked from `source`: the same inode, in constant time),
    given `meta` (mode, and when recorded owner, xattrs, times), fsynced and
    renamed over `target`, and the directory fsynced unless the caller
    fsyncs it later.  A symlink planted at `target` is replaced, one on the
    way refused; a directory the build removed is made again."""
    mutation_point()
    write_point(target)
    directory = open_parent(target, create=True)
    try:
        name = os.path.basename(target)
        tmp = os.path.basename(temp_beside(target))
        unlink_at(directory, tmp)
        linked = False
        if link_ok:
            try:
                os.link(source, tmp, dst_dir_fd=directory, follow_symlinks=False)
                linked = True
            except OSError:
                pass
        flags = os.O_RDONLY if linked else os.O_WRONLY | os.O_CREAT | os.O_EXCL
        fd = os.open(tmp, flags | os.O_NOFOLLOW, 0o600, dir_fd=directory)
        try:
            if data is not None:
                _write_all(fd, data)
            elif not linked:
                copy_sparse(source, fd)
            set_metadata(fd, meta)
            os.fsync(fd)
        except BaseException:
            os.close(fd)
            unlink_at(directory, tmp)
            raise
        os.close(fd)
        os.replace(tmp, name, src_dir_fd=directory, dst_dir_fd=directory)
        if sync_directory:
            os.fsync(directory)
    finally:
        os.close(directory)


def put_symlink(path: str, target: str, mtime_ns: int) -> None:
    """Put a symlink to `target` with mtime `mtime_ns` at `path`: made under a
    temporary name beside it and renamed over whatever is there."""
    mutation_point()
    directory = open_parent(path, create=True)
    try:
        tmp = os.path.basename(temp_beside(path))
        unlink_at(directory, tmp)
        os.symlink(target, tmp, dir_fd=directory)
        os.utime(tmp, ns=(mtime_ns, mtime_ns), dir_fd=directory, follow_symlinks=False)
        os.replace(tmp, os.path.basename(path), src_dir_fd=directory, dst_dir_fd=directory)
        os.fsync(directory)
    finally:
        os.close(directory)


def unlink_at(directory: int, name: str) -> bool:
    """Remove a file or symlink from an open directory; False when absent."""
    try:
        os.unlink(name, dir_fd=directory)
    except FileNotFoundError:
        return False
    return True


def remove_file(path: str, sync_directory: bool = True) -> None:
    """Remove the file or symlink at `path` (nothing when it is absent),
    reaching it without following a symlink; the directory is fsynced
    unless the caller fsyncs it later."""
    try:
        directory = open_parent(path)
    except FileNotFoundError:
        return
    try:
        try:
            os.stat(os.path.basename(path), dir_fd=directory, follow_symlinks=False)
        except FileNotFoundError:
            return
        mutation_point()
        unlink_at(directory, os.path.basename(path))
        if sync_directory:
            os.fsync(directory)
    finally:
        os.close(directory)


def file_sha256(path: str) -> Optional[str]:
    """sha256 of a regular file; None when absent; 'symlink:<target>' or 'special' otherwise."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return None
    if stat.S_ISLNK(st.st_mode):
        return "symlink:" + os.readlink(path)
    if not stat.S_ISREG(st.st_mode):
        return "special"
    hasher = hashlib.sha256()
    try:
        handle = open(path, "rb")
    except FileNotFoundError:  # removed since the lstat (a linker replacing it)
        return None
    except OSError as exc:
        raise read_failure(exc, path)
    with handle:
        while True:
            try:
                block = handle.read(CHUNK)
            except OSError as exc:
                raise read_failure(exc, path)
            if not block:
                break
            hasher.update(block)
    return hasher.hexdigest()


def content_identity(path: str) -> Optional[list]:
    """file_identity of what reading `path` gives, through symlinks; None when
    nothing is there.  A file with the same identity was not written since: a
    hash taken of it then still holds."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return [st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns]


def content_sha256(path: str) -> Optional[str]:
    """sha256 of what reading `path` gives, through symlinks: a library moved
    aside and linked back under its name has the same content.  None when
    nothing readable is there."""
    try:
        if not stat.S_ISREG(os.stat(path).st_mode):
            return None
    except OSError:
        return None
    return file_sha256(os.path.realpath(path))


def written(exc: OSError) -> str:
    """The file an I/O error is about, for a one-line message: the one it
    names, else the one being written (os.write and sendfile name none)."""
    if exc.filename is not None:
        return exc.filename
    return _FAULTS["target"] or "a file"


def read_failure(exc: OSError, path: str) -> OSError:
    """`exc`, marked as the failure to read `path` (io_failure says so)."""
    exc.filename = exc.filename or path
    exc.reading = True  # type: ignore[attr-defined]
    return exc


def io_failure(exc: OSError) -> str:
    """What an I/O error stopped, for a one-line message."""
    if getattr(exc, "reading", False):
        return "could not read %s" % exc.filename
    return "could not write %s" % written(exc)


# ---------------------------------------------------------------- paths


def require_abs_normal(path: str, option: str) -> str:
    """`path` made absolute against the current directory and normalised.
    A '..' is taken lexically only where it leaves an existing directory
    that no symlink leads to (the current directory is one: the kernel
    gives it without symlinks); else the normalised path could name another
    file, and it is refused."""
    if not path or path == "/":
        raise UsageError("E101", "%s must name a file (got %r)" % (option, path))
    full = os.path.join(os.getcwd(), path)
    parts = full.split("/")
    for n, part in enumerate(parts):
        before = "/".join(parts[:n]) or "/"
        if part == ".." and (not os.path.isdir(before)
                             or os.path.realpath(before) != os.path.normpath(before)):
            raise UsageError("E101", "%s %r goes up ('..') from %s, which %s, so its normalised "
                             "form may name another file; pass the path without '..', e.g. %s"
                             % (option, path, os.path.normpath(before),
                                "is no directory" if not os.path.isdir(before)
                                else "is or lies under a symbolic link", os.path.realpath(full)))
    return os.path.normpath(full)


def shown(path: str) -> str:
    """`path` as a person at a terminal reads it: relative to the current
    directory where it lies under it, else as it is."""
    try:
        here = os.getcwd()
    except OSError:  # the current directory was removed
        return path
    return os.path.relpath(path, here) if path != here and is_within(path, here) else path


def shown_list(paths: List[str], more: str = "") -> str:
    """Paths as shown(), the first four and a count of the rest (`more` after it)."""
    names = [shown(path) for path in paths]
    if len(names) > 5:  # a patched common header can reach hundreds of objects
        names[4:] = ["and %d more%s" % (len(names) - 4, more)]
    return ", ".join(names)


def is_within(path: str, root: str) -> bool:
    return path == root or path.startswith(root.rstrip("/") + "/")


def mount_of(path: str) -> Tuple[int, int]:
    """(device, mount id) of the nearest existing directory at or above
    `path`.  A rename or a hard link works only within one mount: two bind
    mounts of one filesystem share the device, yet the kernel refuses a
    rename between them (EXDEV).  Linux names an open file's mount in
    /proc/self/fdinfo; where that cannot be read the device alone stands in."""
    while not os.path.isdir(path):
        path = os.path.dirname(path)
    fd = os.open(path, getattr(os, "O_PATH", os.O_RDONLY) | os.O_DIRECTORY)  # no read right needed
    try:
        device = os.fstat(fd).st_dev
        try:
            with open("/proc/self/fdinfo/%d" % fd, encoding="ascii") as handle:
                for line in handle:
                    if line.startswith("mnt_id:"):
                        return device, int(line.split()[1])
        except (OSError, ValueError):
            pass
        return device, -1
    finally:
        os.close(fd)


def host_name() -> str:
    return os.uname().nodename


def pid_namespace() -> Optional[str]:
    """This process's pid namespace ('pid:[4026531836]'): a pid means a
    process only in the namespace it was read in."""
    try:
        return os.readlink("/proc/self/ns/pid")
    except OSError:
        return None


def boot_id() -> Optional[str]:
    """This boot of the machine: no process outlives it."""
    try:
        with open("/proc/sys/kernel/random/boot_id", encoding="ascii") as handle:
            return handle.read().strip()
    except OSError:
        return None


def process_record(pid: int) -> dict:
    """A process as recorded in the journal: its pid, start time and where
    that pid means it (host, pid namespace of this run, boot)."""
    return {"pid": pid, "start_time": process_start_time(pid), "host": host_name(),
            "pid_ns": pid_namespace(), "boot_id": boot_id()}


# ---------------------------------------------------------------- owners


def process_start_time(pid: int) -> Optional[str]:
    """Start time of a process in clock ticks since boot (Linux), else None."""
    try:
        with open("/proc/%d/stat" % pid, "rb") as handle:
            text = handle.read().decode("ascii", "replace")
    except OSError:
        return None
    fields = text[text.rfind(")") + 2:].split()
    return fields[19] if len(fields) > 19 else None


def pid_exists(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except (ProcessLookupError, OverflowError):  # no pid is that large
        return False
    except PermissionError:
        return True
    return True


def process_name(pid: int) -> str:
    try:
        with open("/proc/%d/comm" % pid, encoding="utf-8", errors="replace") as handle:
            return handle.read().strip()
    except OSError:
        return ""


def parent_of(pid: int) -> int:
    try:
        with open("/proc/%d/stat" % pid, "rb") as handle:
            text = handle.read().decode("ascii", "replace")
        return int(text[text.rfind(")") + 2:].split()[1])
    except (OSError, ValueError, IndexError):
        return 0


SESSION_WRAPPERS = ("sudo", "su", "setsid", "runuser")  # each starts a session of its own


def default_owner() -> int:
    """The leader of this session, looking through the wrappers that start
    a session of their own.  Where there is no usable leader (none left, the
    system's init, which never goes away, or one outside this pid namespace,
    for which getsid() answers 0), the process that started this command.
    A program that imports this module owns what it applies when it leads
    its session or sees no usable leader, as it owns the commands it starts;
    0 when nothing can own it (pid 1 of a namespace has no parent)."""
    pid = os.getpid()
    imported = __name__ != "__main__"
    if imported and os.getsid(0) == pid:
        return pid
    for _ in range(8):
        try:
            leader = os.getsid(pid)
        except OSError:
            break
        if leader != os.getpid() and process_name(leader) not in SESSION_WRAPPERS:
            if leader > 1 and pid_exists(leader):
                return leader
            break
        pid = parent_of(leader)
        if pid <= 1:
            break
    return os.getpid() if imported else os.getppid()


def make_owner(pid: int) -> dict:
    if pid <= 0 or not pid_exists(pid):
        raise UsageError("E108", "--owner-pid %d is not a running process; pass the pid of the "
                         "process that owns this overlay" % pid)
    return process_record(pid)


def owner_liveness(owner: Optional[dict]) -> str:
    """'live', 'gone', or what cannot be checked from here: 'other-host',
    'other-namespace' (its pid names another process, or none, here)."""
    if not owner:
        return "gone"
    if owner.get("host") != host_name():
        return "other-host"
    if owner.get("boot_id") not in (None, boot_id()):
        return "gone"  # the machine restarted since
    if owner.get("pid_ns") not in (None, pid_namespace()):
        return "other-namespace"
    pid = owner.get("pid")
    if not isinstance(pid, int) or not pid_exists(pid):
        return "gone"
    recorded = owner.get("start_time")
    if recorded is not None and process_start_time(pid) != recorded:
        return "gone"
    return "live"


def same_process(recorded: dict, process: dict) -> bool:
    """Whether two journaled processes are one (a journal of version 1.0
    recorded no pid namespace)."""
    return all(recorded.get(key) == process[key] for key in ("pid", "start_time", "host")) \
        and recorded.get("pid_ns") in (None, process["pid_ns"])


def describe_owner(owner: Optional[dict]) -> str:
    if not owner:
        return "none"
    liveness = owner_liveness(owner)
    return "pid %s on %s (%s)" % (owner.get("pid"), owner.get("host"), {
        "other-namespace": "in another pid namespace: cannot tell from here"}.get(liveness,
                                                                                liveness))


# ---------------------------------------------------------------- the state directory


class State:
    """The state directory: journal, lock, backups, Python overlay."""

    def __init__(self, root: str):
        self.root = root
        self.lock_path = os.path.join(root, "lock")
        self.backups = os.path.join(root, "backups")
        self.site = os.path.join(root, "site")
        self.python = os.path.join(root, "python")
        self.lock_fd: Optional[int] = None
        self.inside: set = set()  # folders state_path found inside the state directory

    @property
    def journal_path(self) -> str:
        """The journal's file: journal.json, or in a state directory that
        version 1.0 wrote, manifest.json until the next write replaces it."""
        path = os.path.join(self.root, JOURNAL_NAME)
        old = os.path.join(self.root, OLD_JOURNAL_NAME)
        return old if not os.path.lexists(path) and os.path.lexists(old) else path

    # -- existence and safety

    def exists(self) -> bool:
        return os.path.isfile(self.journal_path)

    def orphaned_backups(self) -> bool:
        """Backups with no journal: it was deleted while something was applied."""
        backups = os.path.join(self.root, "backups")
        return not self.exists() and os.path.isdir(backups) and bool(os.listdir(backups))

    def check_safe(self) -> None:
        try:
            st = os.lstat(self.root)
        except (FileNotFoundError, NotADirectoryError):  # creating it says what is in the way
            return
        if not stat.S_ISDIR(st.st_mode):
            raise OverlayError("E206", "state directory %s is not a directory; pass another "
                               "--state" % self.root)
        if st.st_uid != os.geteuid():
            raise OverlayError("E204", "state directory %s is owned by uid %d, not by you (uid %d); "
                               "refusing to use it" % (self.root, st.st_uid, os.geteuid()))
        if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
            raise OverlayError("E204", "state directory %s is writable by group or others (mode "
                               "%03o); refusing to use it: run `chmod go-w %s` if you trust its "
                               "contents" % (self.root, stat.S_IMODE(st.st_mode), self.root))

    def check_private(self) -> None:
        """The backups may be copies of privileged files: nobody else may enter."""
        st = os.lstat(self.root)
        if st.st_mode & stat.S_IXOTH:
            raise OverlayError("E204", "state directory %s can be entered by others (mode %03o); "
                               "refusing to keep backups there: run `chmod o-rwx %s`"
                               % (self.root, stat.S_IMODE(st.st_mode), self.root))

    def check_ours(self) -> None:
        """Refuse a directory that is not this tool's state before anything,
        the lock included, is written into it.  What a concurrent first use
        leaves (a lock, a journal being written) is this tool's."""
        try:
            names = set(os.listdir(self.root))
        except FileNotFoundError:
            return
        if JOURNAL_NAME in names or OLD_JOURNAL_NAME in names or self.exists():
            self.read_journal()
            return
        if self.orphaned_backups():
            return  # load() names the missing journal
        foreign = sorted(name for name in names - {"lock"} if not name.startswith(TEMP_PREFIX))
        if "lock" in names and not self.lock_is_ours():
            foreign.insert(0, "lock")
        if foreign and not self.exists():  # a journal renamed into place during the listing
            raise OverlayError("E206", "state directory %s already holds %s and no journal; "
                               "it is not an overlay state directory: pass a new or empty "
                               "--state" % (self.root, ", ".join(foreign[:3]) + (
                                   ", ..." if len(foreign) > 3 else "")))

    def lock_is_ours(self) -> bool:
        try:
            fd = os.open(self.lock_path, os.O_RDONLY | os.O_NOFOLLOW)
        except OSError:
            return False
        try:
            text = os.read(fd, 4096)
        finally:
            os.close(fd)
        if not text:
            return True
        try:
            info = json.loads(text.decode("utf-8"))
        except ValueError:
            return False
        return isinstance(info, dict) and set(info) == {"pid", "host", "command", "since"}

    def create(self) -> None:
        self.check_safe()
        self.check_ours()
        if is_within(self.root, state_home()):
            check_state_home()
        makedirs_durable(self.root, 0o700)
        self.check_safe()

    def holder(self) -> str:
        try:
            with open(self.lock_path, encoding="utf-8") as handle:
                info = json.loads(handle.read() or "{}")
        except (OSError, ValueError):
            return "an unknown process"
        return "pid %s on %s (%s since %s)" % (info.get("pid"), info.get("host"),
                                              info.get("command"), info.get("since"))

    def lock_held(self) -> bool:
        """Whether a command holds the lock, asked without writing anything,
        so that `status` works on a read-only state directory too."""
        try:
            fd = os.open(self.lock_path, os.O_RDONLY | os.O_NOFOLLOW)
        except FileNotFoundError:
            return False
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            return True
        finally:
            os.close(fd)
        return False

    def try_lock(self, command: str) -> bool:
        self.check_ours()
        self.check_private()
        fd = os.open(self.lock_path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            return False
        self._hold(fd, command)
        return True

    def lock(self, command: str) -> None:
        if self.try_lock(command):
            return
        print("waiting for the lock on %s, held by %s" % (self.root, self.holder()),
              file=sys.stderr, flush=True)
        fd = os.open(self.lock_path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
        fcntl.flock(fd, fcntl.LOCK_EX)
        self._hold(fd, command)

    def _hold(self, fd: int, command: str) -> None:
        info = {"pid": os.getpid(), "host": host_name(), "command": command,
                "since": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(info).encode(), 0)
        self.lock_fd = fd

    def unlock(self) -> None:
        if self.lock_fd is not None:
            os.ftruncate(self.lock_fd, 0)
            fcntl.flock(self.lock_fd, fcntl.LOCK_UN)
            os.close(self.lock_fd)
            self.lock_fd = None

    # -- journal

    def read_journal(self) -> Optional[dict]:
        """The journal as written, None when there is none; E202 when it is
        unreadable or another program's."""
        try:
            with open(self.journal_path, encoding="utf-8") as handle:
                journal = json.load(handle)
        except FileNotFoundError:
            return None
        except (OSError, ValueError) as exc:
            raise OverlayError("E202", "journal %s is unreadable (%s); inspect it, or move the "
                               "state directory away if nothing is applied"
                               % (self.journal_path, exc))
        if not isinstance(journal, dict) or journal.get("tool") != TOOL_NAME:
            raise OverlayError("E202", "journal %s is not an overlay_setup journal; pass another "
                               "--state" % self.journal_path)
        return journal

    def load(self) -> dict:
        journal = self.read_journal()
        if journal is None:
            if self.orphaned_backups():
                raise OverlayError("E202", "journal %s is missing, but %s holds the backups of "
                                   "entries that may still be applied; restore the journal, or "
                                   "put the files back from there by hand"
                                   % (self.journal_path, os.path.join(self.root, "backups")))
            return empty_journal()
        version = journal.get("format")
        if not isinstance(version, int) or version > FORMAT_VERSION:
            raise OverlayError("E201", "journal %s has format %r, newer than this tool understands "
                               "(%d); use the overlay_setup.py that wrote it"
                               % (self.journal_path, version, FORMAT_VERSION))
        try:
            self.validate(journal)
        except (KeyError, TypeError, AttributeError) as exc:
            raise OverlayError("E202", "journal %s lacks or mistypes a field (%s); inspect it"
                               % (self.journal_path, exc))
        return journal

    def check_fields(self, journal: dict) -> None:
        problem = journal_field_problem(journal)
        if problem:
            raise OverlayError("E202", "journal %s has a missing or mistyped %s; it was edited or "
                               "damaged, and nothing was changed: restore it, or move the state "
                               "directory away if nothing is applied"
                               % (self.journal_path, problem))

    def save(self, journal: dict) -> None:
        path = os.path.join(self.root, JOURNAL_NAME)
        # One line: the C encoder, ten times faster than the indenting one on
        # the thousands of records an installed distribution brings.
        durable_write(path, (json.dumps(journal, sort_keys=True) + "\n").encode())
        # Version 1.0's journal, which this one replaces; also one that a run
        # killed before this removal left beside it, stale, for 1.0 to act on.
        old = os.path.join(self.root, OLD_JOURNAL_NAME)
        if os.path.lexists(old) and not os.path.isdir(old):  # a folder of that name is no journal
            os.unlink(old)
            fsync_dir(self.root)

    def reserve_space(self, journal: dict) -> None:
        """Hold some space on the state's disk while the build runs, which
        may fill it with its own files: freed once the build is over (or by
        the next command, after a run killed in it), so that the build's end
        is journaled and revert can run, which removes what the build made.
        Best effort: a disk too full for it already gets none."""
        path = os.path.join(self.root, RESERVE_NAME)
        if os.path.exists(path):
            return
        size = max(RESERVE_SIZE, 4 * len(json.dumps(journal)))
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        except OSError:
            return
        try:
            for start in range(0, size, CHUNK):
                _write_all(fd, bytes(min(CHUNK, size - start)))
            os.fsync(fd)
        except OSError:
            os.close(fd)
            self.release_space()
            return
        os.close(fd)

    def release_space(self) -> bool:
        """Free the space reserve_space held; whether there was any."""
        try:
            os.unlink(os.path.join(self.root, RESERVE_NAME))
        except FileNotFoundError:
            return False
        fsync_dir(self.root)
        return True

    def state_path(self, relative: str) -> str:
        """A path recorded relative to the state directory, checked to stay inside it."""
        if (not isinstance(relative, str) or not relative or os.path.isabs(relative)
                or os.path.normpath(relative) != relative or relative.split("/")[0] == ".."):
            raise OverlayError("E203", "journal %s names backup %r outside the state directory; "
                               "the journal was tampered with, nothing was changed"
                               % (self.journal_path, relative))
        full = os.path.join(self.root, relative)
        folder = os.path.dirname(full)
        if folder in self.inside:  # thousands of backups share a few folders
            return full
        if not is_within(os.path.realpath(folder), os.path.realpath(self.root)):
            raise OverlayError("E203", "journal %s names backup %r that resolves outside the state "
                               "directory; nothing was changed" % (self.journal_path, relative))
        self.inside.add(folder)
        return full

    def validate(self, journal: dict) -> None:
        """Check every field and path of a journal read back from disk before
        anything acts on it."""
        self.check_fields(journal)
        def target(path: object, what: str) -> None:
            if (not isinstance(path, str) or not os.path.isabs(path)
                    or os.path.normpath(path) != path or path == "/"):
                raise OverlayError("E203", "journal %s names %s %r that is not an absolute, "
                                   "normalised path; the journal was tampered with, nothing was "
                                   "changed" % (self.journal_path, what, path))
        entries = journal.get("entries")
        if not isinstance(entries, list):
            raise OverlayError("E202", "journal %s has no entry list; inspect it"
                               % self.journal_path)
        for entry in entries:
            for root in entry["roots"]:
                target(root, "install root")
            def inside_roots(path: str) -> None:
                if not any(is_within(path, root) for root in entry["roots"]):
                    raise OverlayError("E203", "journal %s names %s outside the install roots "
                                       "its entry %s recorded (%s); the journal was altered, "
                                       "nothing was changed" % (self.journal_path, path,
                                                                entry["id"],
                                                                ", ".join(entry["roots"])))
            for record in entry_files(entry):
                target(record.get("path"), "target")
                inside_roots(record["path"])
                for key in ("backup", "inode_backup"):
                    if record.get(key) is not None:
                        self.state_path(record[key])
                xattrs = record.get("xattrs") or {}
                if not (isinstance(xattrs, dict) and all(
                        isinstance(value, str) and re.match(r"^([0-9a-f]{2})*$", value)
                        for value in xattrs.values())):
                    raise OverlayError("E202", "journal %s has mistyped extended attributes for "
                                       "%s; it was edited or damaged, and nothing was changed"
                                       % (self.journal_path, record["path"]))
            for cache in entry.get("caches", []):
                target(cache.get("path"), "cache")
                inside_roots(cache["path"])
                self.state_path(cache["backup"])
            build = entry.get("build")
            if build:
                target(build.get("cwd"), "build directory")
                inside_roots(build["cwd"])
                for tree in build_trees(build):
                    target(tree, "build directory")
                    inside_roots(tree)
                for product in (entry.get("untracked") or []) + (
                        entry.get("earlier_untracked") or []):
                    target(product.get("path"), "build product")
                    if not any(is_within(product["path"], tree) for tree in build_trees(build)):
                        raise OverlayError("E203", "journal %s names build product %r outside "
                                           "the build directory %s; nothing was changed"
                                           % (self.journal_path, product["path"], build["cwd"]))
            for key in ("scan", "build_scan"):
                if entry.get(key) is not None:
                    self.state_path(entry[key])
            jit = entry.get("jit")
            if jit is not None:
                if not (isinstance(jit, dict) and isinstance(jit.get("directories"), list)
                        and isinstance(jit.get("scan"), str)):
                    raise OverlayError("E202", "journal %s has a damaged JIT record in entry %s; "
                                       "nothing was changed" % (self.journal_path, entry["id"]))
                for directory in jit["directories"]:
                    target(directory, "JIT build directory")
                    inside_roots(directory)
                self.state_path(jit["scan"])
            for directory in entry.get("dirs", {}):
                target(directory, "directory")
        for name, module in journal.get("python", {}).get("modules", {}).items():
            if module.get("file") is not None:
                self.state_path(module["file"])


JOURNAL_FIELDS = {  # what each record of the journal must hold, by type
    "owner": {"pid": int, "host": str, "start_time": (str, type(None)),
              "pid_ns": (str, type(None)), "boot_id": (str, type(None))},
    "process": {"pid": int, "host": str, "start_time": (str, type(None)),
                "pid_ns": (str, type(None)), "boot_id": (str, type(None))},
    "entry": {"id": int, "state": str, "sources": list, "artifacts": list, "caches": list,
              "dirs": (dict,), "roots": list, "build": (dict, type(None)),
              "scan": (str, type(None)), "untracked": (list, type(None)),
              "protected": (list, type(None))},
    "file": {"path": str, "present": bool, "backup": (str, type(None)), "mode": (int, type(None)),
             "uid": (int, type(None)), "gid": (int, type(None)),
             "mtime_ns": (int, type(None)), "atime_ns": (int, type(None))},
    "cache": {"path": str, "present": bool, "method": str, "backup": str,
              "mtime_ns": (int, type(None))},
    "build": {"cmd": str, "cwd": str},
    "product": {"path": str, "kind": str, "created": bool},
}


def journal_field_problem(journal: dict) -> Optional[str]:
    """The first missing or mistyped field of a journal, or None."""
    def bad(record: object, kind: str, where: str) -> Optional[str]:
        if not isinstance(record, dict):
            return where
        present = kind == "file" and record.get("present") is True
        for key, types in JOURNAL_FIELDS[kind].items():
            optional = isinstance(types, tuple) and not present  # a file there has all of them
            if key not in record:
                if optional:
                    continue
                return "%s.%s" % (where, key)
            value = record[key]
            if not isinstance(value, types) or (present and value is None) or (
                    isinstance(value, bool) and types is not bool):
                return "%s.%s" % (where, key)
        return None
    if type(journal.get("next_id")) is not int:
        return "next_id"
    python = journal.get("python")
    if not (isinstance(python, dict) and isinstance(python.get("modules"), dict)
            and isinstance(python.get("rebinds"), dict)):
        return "python"
    problems = [bad(journal["owner"], "owner", "owner")] if journal.get("owner") is not None \
        else []
    for number, entry in enumerate(journal.get("entries") or []):
        where = "entries[%d]" % number
        problems.append(bad(entry, "entry", where))
        if problems[-1]:
            break
        problems += [bad(r, "file", "%s.sources[%d]" % (where, i))
                     for i, r in enumerate(entry["sources"])]
        problems += [bad(r, "file", "%s.artifacts[%d]" % (where, i))
                     for i, r in enumerate(entry["artifacts"])]
        problems += [bad(r, "file", "%s.protected[%d]" % (where, i))
                     for i, r in enumerate(entry.get("protected") or [])]
        problems += [bad(r, "cache", "%s.caches[%d]" % (where, i))
                     for i, r in enumerate(entry["caches"])]
        if entry.get("build") is not None:
            problems.append(bad(entry["build"], "build", where + ".build"))
            if entry["build"].get("process") is not None:
                problems.append(bad(entry["build"]["process"], "process", where + ".build.process"))
        for key in ("untracked", "earlier_untracked"):
            problems += [bad(p, "product", "%s.%s[%d]" % (where, key, i))
                         for i, p in enumerate(entry.get(key) or [])]
        if not all(isinstance(k, str) and type(v) is int
                   for k, v in entry.get("dirs", {}).items()):
            problems.append(where + ".dirs")
    return next((p for p in problems if p), None)


def entry_files(entry: dict) -> List[dict]:
    """The file records of an entry that revert restores: sources, artifacts
    and the build products backed up before the build."""
    return entry.get("sources", []) + entry.get("artifacts", []) + (entry.get("protected") or [])


def empty_journal() -> dict:
    return {"tool": TOOL_NAME, "format": FORMAT_VERSION, "owner": None, "next_id": 1,
            "entries": [], "python": {"modules": {}, "rebinds": {}}}


def anything_applied(journal: dict) -> bool:
    python = journal.get("python", {})
    return bool(journal["entries"] or python.get("modules") or python.get("rebinds"))


def tool_at(state: State) -> str:
    """The command line that reaches `state` from where the user stands, for
    the next command a message tells the user to run: --state only where the
    command without it would find another state directory."""
    if state.root == state_root(argparse.Namespace(state=None)):
        return "overlay_setup.py"
    return "overlay_setup.py --state %s" % shell_quote(state.root)


def interrupted(state: State, journal: dict) -> Optional[str]:
    """What a run of this tool was doing when it stopped halfway: an entry
    being applied, built or updated, or a revert begun.  Found with the lock
    free, nobody is doing it any more: the entry is stale whoever the owner
    is, as a hot journal nobody holds is rolled back."""
    if journal.get("reverting"):
        return "reverting"
    return next(filter(None, (entry.interrupted() for entry in native_entries(state, journal))),
                None)


def resolve_owner(owner_pid: Optional[int]) -> dict:
    """The owner a command records: --owner-pid, or default_owner().  Called
    before the state directory is made, so that a refusal leaves nothing."""
    if owner_pid is None:
        owner_pid = default_owner()
        if owner_pid <= 0:
            raise UsageError("E108", "no process can own this overlay: this one is pid 1 of its "
                             "namespace and has no parent; pass --owner-pid with the pid of the "
                             "process that uses the overlay")
    return make_owner(owner_pid)


def claim_owner(state: State, journal: dict, owner: dict) -> None:
    """Record the owner; a state directory with changes from another owner is refused."""
    current = journal.get("owner")
    if anything_applied(journal) and current and not same_process(current, owner):
        liveness = owner_liveness(current)
        if liveness == "live":
            hint = ("pass --owner-pid %s to add to it, or run `%s revert` first"
                    % (current["pid"], tool_at(state)))
        elif liveness == "gone":
            hint = "its owner is gone: run `%s revert` first" % tool_at(state)
        else:
            hint = ("run `%s revert` %s, or here if that run is over"
                    % (tool_at(state), "in that pid namespace" if liveness == "other-namespace"
                       else "on %s" % current["host"]))
        raise OverlayError("E205", "this overlay belongs to %s; %s" % (describe_owner(current),
                                                                       hint))
    journal["owner"] = owner


# ---------------------------------------------------------------- where state directories live
#
# The default state directory of the directory a command runs from lies
# outside every install: $XDG_STATE_HOME/overlay_setup/<that path>-<hash>.
# That folder's listing is the registry of applied overlays, so `status`,
# `revert --all` and `gc-stale` find them from any directory.  A state
# directory elsewhere (--state, $OVERLAY_STATE, or the ./.overlay that
# version 1.0 made by default) gets a small record under its applied/ folder
# instead, written before its first change and removed after a full revert.


def state_home() -> str:
    base = os.environ.get("XDG_STATE_HOME", "")
    if not os.path.isabs(base):  # the XDG rule: unset, empty or relative means the default
        base = os.path.join(os.path.expanduser("~"), ".local", "state")
    return os.path.join(os.path.normpath(base), TOOL_NAME)


def check_state_home() -> None:
    """The state home is made only in a directory of this user's or the
    system's: root with a user's HOME (sudo -E) would leave there a folder
    of root's that the user could no longer use (E204, E210)."""
    home = path = state_home()
    while not os.path.lexists(path) and os.path.dirname(path) != path:
        path = os.path.dirname(path)
    try:
        owner = os.stat(path).st_uid
    except OSError:
        return  # making it says what is in the way
    if owner not in (os.geteuid(), 0):
        raise OverlayError("E212", "the state home %s would be made in %s, which uid %d owns, "
                           "not you (uid %d), and that user could no longer use it (sudo -E "
                           "keeps the user's HOME); nothing was changed: pass --state DIR, or "
                           "set XDG_STATE_HOME to a directory of yours"
                           % (home, path, owner, os.geteuid()))


def registry_dir() -> str:
    return os.path.join(state_home(), "applied")


def default_state_dir(directory: str) -> str:
    """The state directory for commands run from `directory`: named after
    its path, so that a person can tell which install it belongs to, and a
    hash of it, so that two paths never share one."""
    label = re.sub(r"[^A-Za-z0-9._+-]+", "_", directory.strip("/").replace("/", "-"))
    digest = hashlib.sha256(directory.encode("utf-8", "surrogateescape")).hexdigest()[:8]
    return os.path.join(state_home(), "%s-%s" % (label[-60:].lstrip("-._") or "root", digest))


def in_state_home(root: str) -> bool:
    return os.path.dirname(root) == state_home()


def registry_record(state_root: str) -> str:
    name = hashlib.sha256(state_root.encode("utf-8", "surrogateescape")).hexdigest()[:32]
    return os.path.join(registry_dir(), name + ".json")


def register(state: "State") -> None:
    """Record a state directory outside the state home durably before its
    first change (one inside it is listed by being there)."""
    record = registry_record(state.root)
    if in_state_home(state.root) or os.path.isfile(record):
        return
    check_state_home()
    makedirs_durable(registry_dir(), 0o700)
    durable_write(record, (json.dumps({"state": state.root}) + "\n").encode())


def unregister(state: "State") -> None:
    if not in_state_home(state.root):
        remove_path(registry_record(state.root))


def holds_something(state: "State") -> bool:
    """Whether a state directory may hold something applied: a damaged
    journal counts, for the commands on it to say why."""
    if state.orphaned_backups():
        return True
    try:
        journal = state.read_journal()
        return journal is not None and anything_applied(journal)
    except (OverlayError, KeyError, TypeError, AttributeError):
        return True


def registered_states() -> List[str]:
    """The state directories of this user's registry: those of the state
    home that hold something, and the recorded ones elsewhere (applied or
    not: the caller loads each)."""
    found = []
    try:
        names = sorted(os.listdir(state_home()))
    except OSError:
        names = []
    for name in names:
        root = os.path.join(state_home(), name)
        if name != "applied" and not os.path.islink(root) and os.path.isdir(root) \
                and holds_something(State(root)):
            found.append(root)
    try:
        names = sorted(os.listdir(registry_dir()))
    except OSError:
        names = []
    for name in names:
        if not name.endswith(".json"):
            continue
        try:
            with open(os.path.join(registry_dir(), name), encoding="utf-8") as handle:
                root = json.load(handle).get("state")
        except (OSError, ValueError, AttributeError):
            continue
        if isinstance(root, str) and os.path.isabs(root) and os.path.normpath(root) == root:
            found.append(root)
    return sorted(set(found))


def vanished_state(state: "State") -> "OverlayError":
    """A registered state directory whose journal is gone: it was deleted
    while something was applied."""
    return OverlayError("E209", "state directory %s is registered with an overlay applied, but "
                        "its journal is gone (deleted by a build's clean step, or by hand): the "
                        "install may still be patched and its backups are lost; restore the "
                        "patched files from version control or a reinstall, then delete %s"
                        % (state.root, registry_record(state.root)))


def applied_states(skip: Optional[str] = None) -> List[Tuple["State", Optional[dict]]]:
    """This user's registered state directories that hold something applied,
    with their journals (read without the lock: for reports and refusals)."""
    found = []
    for root in registered_states():
        if root == skip:
            continue
        state = State(root)
        try:
            state.check_safe()
            if not (state.exists() or state.orphaned_backups()):
                found.append((state, None))  # vanished: named all the same
                continue
            journal = state.load()
        except OverlayError:  # damaged: named all the same, the commands on it say why
            found.append((state, None))
            continue
        except OSError:
            continue
        if anything_applied(journal):
            found.append((state, journal))
    return found


# ---------------------------------------------------------------- the Python overlay

SITECUSTOMIZE = '''"""Generated by overlay_setup.py; rewritten by every change to the overlay.

Serves overlaid modules and rebinds listed in overlay.json next to this file,
then runs any other sitecustomize found further along sys.path.  With the
overlay switched off it installs nothing and only chains.
"""
import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import json
import os
import sys

_HERE = os.path.dirname(os.path.abspath(__file__))


def _config():
    try:
        with open(os.path.join(_HERE, "overlay.json"), encoding="utf-8") as handle:
            return json.load(handle)
    except (OSError, ValueError):
        return {"enabled": False}


def _rebind(module, rebinds):
    for attr, replacement in sorted(rebinds.items()):
        other, _, other_attr = replacement.partition(":")
        setattr(module, attr, getattr(importlib.import_module(other), other_attr))


class _RebindingLoader(importlib.abc.Loader):
    def __init__(self, loader, rebinds):
        self._loader = loader
        self._rebinds = rebinds

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module):
        self._loader.exec_module(module)
        _rebind(module, self._rebinds)

    def __getattr__(self, name):
        return getattr(self._loader, name)


class _OverlayFinder(importlib.abc.MetaPathFinder):
    def __init__(self, modules, rebinds):
        self._modules = modules
        self._rebinds = rebinds

    def find_spec(self, fullname, path=None, target=None):
        module = self._modules.get(fullname)
        if module is not None:
            if module["file"] is None:
                raise ModuleNotFoundError("module %r is deleted by the overlay" % fullname,
                                          name=fullname)
            spec = importlib.util.spec_from_file_location(
                fullname, module["file"],
                submodule_search_locations=module.get("package_dir") and [module["package_dir"]])
        elif fullname in self._rebinds:
            spec = None
            for finder in sys.meta_path:
                if finder is self or not hasattr(finder, "find_spec"):
                    continue
                spec = finder.find_spec(fullname, path, target)
                if spec is not None:
                    break
        else:
            return None
        if spec is not None and spec.loader is not None and fullname in self._rebinds:
            spec.loader = _RebindingLoader(spec.loader, self._rebinds[fullname])
        return spec


def _install():
    config = _config()
    if not config.get("enabled"):
        return
    rebinds = {}
    for target, replacement in config.get("rebinds", {}).items():
        module, _, attr = target.partition(":")
        rebinds.setdefault(module, {})[attr] = replacement
    finder = _OverlayFinder(config.get("modules", {}), rebinds)
    sys.meta_path.insert(0, finder)
    # A module imported before this point (json by this file, one a .pth
    # file imports) is served anew in place: every later import gets it.
    served = True
    for name in sorted(set(config.get("modules", {})) | set(rebinds)):
        module = sys.modules.get(name)
        if module is None:
            continue
        if name not in config.get("modules", {}):
            try:
                _rebind(module, rebinds[name])
            except ImportError as exc:  # said, not hidden: the process runs unpatched
                sys.stderr.write("overlay_setup: warning: %s was imported before the overlay "
                                 "started and %s cannot be imported yet (%s), so it is not "
                                 "rebound in this process\\n" % (name, exc.name, exc))
                served = False
            continue
        try:
            spec = finder.find_spec(name)
        except ModuleNotFoundError:  # deleted by the overlay
            del sys.modules[name]
            continue
        module.__spec__, module.__file__, module.__loader__ = spec, spec.origin, spec.loader
        spec.loader.exec_module(module)
    marker = os.environ.get("OVERLAY_LOADED")  # set by `trial` for its candidate runs
    if marker and served:
        try:
            with open(marker, "a", encoding="utf-8") as handle:
                handle.write("%d\\n" % os.getpid())
        except OSError:
            pass


def _chain():
    entries = [os.path.abspath(entry or os.getcwd()) for entry in sys.path]
    if _HERE not in entries:
        return
    later = sys.path[entries.index(_HERE) + 1:]
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", later)
    if spec is None or spec.loader is None:
        return
    if spec.origin and os.path.abspath(spec.origin) == os.path.abspath(__file__):
        return
    chained = importlib.util.module_from_spec(spec)
    sys.modules["_overlay_chained_sitecustomize"] = chained
    spec.loader.exec_module(chained)


_install()
_chain()
'''


def write_python_overlay(state: State, journal: dict) -> None:
    """Regenerate the site directory from the journal's Python section."""
    makedirs_durable(state.site)
    python = journal["python"]
    modules = {}
    for name, module in python["modules"].items():
        modules[name] = {"file": module["file"] and os.path.join(state.root, module["file"]),
                         "package_dir": module.get("package_dir")}
    config = {"enabled": bool(modules or python["rebinds"]), "modules": modules,
              "rebinds": python["rebinds"]}
    sitecustomize = os.path.join(state.site, "sitecustomize.py")
    if file_sha256(sitecustomize) != hashlib.sha256(SITECUSTOMIZE.encode()).hexdigest():
        durable_write(sitecustomize, SITECUSTOMIZE.encode(), 0o644)
    durable_write(os.path.join(state.site, "overlay.json"),
                  (json.dumps(config, indent=1, sort_keys=True) + "\n").encode(), 0o644)


def check_python_state(state: State) -> None:
    """The overlay's site folder goes on PYTHONPATH, which splits at ':'."""
    if os.pathsep in state.site:
        raise OverlayError("E213", "the state directory %s holds '%s', which PYTHONPATH takes "
                           "for a separator, so no Python process would load the overlay; "
                           "nothing was changed: pass a --state without '%s' (or an "
                           "XDG_STATE_HOME without it)" % (state.root, os.pathsep, os.pathsep))


def check_module_name(name: str, what: str) -> None:
    if not MODULE_RE.match(name):
        raise UsageError("E105", "%s %r is not a dotted module name (e.g. pkg.mod)" % (what, name))


def stage_python_module(state: State, journal: dict, name: str, content: Optional[bytes],
                        package_dir: Optional[str], origin: str) -> None:
    """Store a module's overlay content in the state directory and record it."""
    if name in journal["python"]["modules"]:
        raise OverlayError("E103", "module %s is already overlaid; run `%s revert` first"
                           % (name, tool_at(state)))
    relative = None
    if content is not None:
        makedirs_durable(state.python)
        relative = "python/%s.py" % name
        durable_write(os.path.join(state.root, relative), content, 0o644)
    journal["python"]["modules"][name] = {"file": relative, "package_dir": package_dir,
                                           "origin": origin}


# ---------------------------------------------------------------- unified diffs


class FilePatch:
    def __init__(self, old: Optional[str], new: Optional[str], mode: Optional[int] = None):
        self.old = old
        self.new = new
        self.mode = mode  # git's mode for the file after the patch (0o644, 0o755), if it says one
        self.hunks: List[Tuple[int, int, int, int, List[Tuple[str, str]]]] = []

    @property
    def path(self) -> str:
        """The file patched: the new name (as `git apply` and `patch` use for
        `--- foo.c.orig` / `+++ foo.c`), or the old one for a deletion."""
        return self.new if self.new is not None else self.old


def split_lines(text: str) -> List[str]:
    return LINE_RE.findall(text)


def strip_components(raw: str, strip: int, patch_name: str) -> Optional[str]:
    raw = raw.split("\t")[0].rstrip("\r")
    if raw.startswith('"'):
        raise OverlayError("E301", "%s: quoted path %s is not supported; regenerate the patch "
                           "with `git diff --no-prefix` or plain names" % (patch_name, raw))
    if raw == "/dev/null":
        return None
    parts = raw.split("/")
    if len(parts) <= strip:
        raise OverlayError("E301", "%s: path %r has fewer than %d components to strip; pass a "
                           "smaller -p" % (patch_name, raw, strip))
    return "/".join(parts[strip:])


def git_header_path(line: str, strip: int, patch_name: str) -> Optional[str]:
    """The file of a `diff --git a/NAME b/NAME` line; None when the two names
    differ (a rename, refused by its own header line) or cannot be told apart."""
    names = line[len("diff --git "):]
    half = len(names) // 2
    if names.startswith('"'):
        strip_components(names, strip, patch_name)  # refuses the quoted path
    if names[half:half + 1] != " " or names[:half].count("/") < strip:
        return None
    old = strip_components(names[:half], strip, patch_name)
    return old if old == strip_components(names[half + 1:], strip, patch_name) else None


def parse_patch(text: str, strip: int, patch_name: str) -> List[FilePatch]:
    """The file parts of a unified diff, with git's extended headers: a part
    with no ---/+++ lines makes or removes an empty file or changes a mode."""
    lines = split_lines(text)
    patches: List[FilePatch] = []
    git: Optional[dict] = None  # the `diff --git` header read last, until its ---/+++ lines

    def add(current: FilePatch) -> None:
        if current.old is None and current.new is None:
            raise OverlayError("E301", "%s: a file goes from /dev/null to /dev/null" % patch_name)
        path = current.path
        if (os.path.isabs(path) or not path or os.path.normpath(path) != path
                or path.split("/")[0] == ".."):
            raise OverlayError("E304", "%s: path %r leaves the --root directory; nothing was "
                               "written" % (patch_name, path))
        if any(earlier.path == current.path for earlier in patches):
            raise OverlayError("E301", "%s: %s appears twice; regenerate the patch with one diff "
                               "per file" % (patch_name, current.path))
        patches.append(current)

    def header_only(git: Optional[dict]) -> None:
        if git is None or not {"new file mode", "deleted file mode", "new mode"} & set(git):
            return  # nothing but an index line: the ---/+++ lines, if any, say the rest
        if git["path"] is None:
            raise OverlayError("E301", "%s: cannot tell the file name in %r; regenerate the patch "
                               "with `git diff --no-renames`" % (patch_name, git["line"]))
        if "new file mode" in git:
            add(FilePatch(None, git["path"], git["new file mode"]))
        elif "deleted file mode" in git:
            add(FilePatch(git["path"], None))
        elif "new mode" in git:
            add(FilePatch(git["path"], git["path"], git["new mode"]))

    index = 0
    while index < len(lines):
        line = lines[index].rstrip("\n").rstrip("\r")
        if line.startswith(("rename from", "copy from")):
            raise OverlayError("E305", "%s: renames and copies are not supported; regenerate the "
                               "patch with `git diff --no-renames`" % patch_name)
        if line.startswith(("Binary files", "GIT binary patch")):
            raise OverlayError("E305", "%s: binary patches are not supported" % patch_name)
        if line.startswith("diff --git "):
            header_only(git)
            git = {"path": git_header_path(line, strip, patch_name), "line": line}
            index += 1
            continue
        match = GIT_HEADER_RE.match(line) if git is not None else None
        if match:
            if match.group(2) not in GIT_MODES:
                raise OverlayError("E305", "%s: %s has mode %s (%s); only regular files (100644, "
                                   "100755) are supported: leave it out of the patch"
                                   % (patch_name, git["path"] or "a file", match.group(2),
                                      GIT_MODE_KINDS.get(match.group(2), "no regular file")))
            git[match.group(1)] = GIT_MODES[match.group(2)]
            index += 1
            continue
        if not (line.startswith("--- ") and index + 1 < len(lines)
                and lines[index + 1].startswith("+++ ")):
            index += 1
            continue
        current = FilePatch(strip_components(line[4:], strip, patch_name),
                            strip_components(lines[index + 1].rstrip("\n")[4:], strip, patch_name),
                            git and git.get("new file mode", git.get("new mode")))
        git = None
        add(current)
        index += 2
        while index < len(lines):
            match = HUNK_RE.match(lines[index])
            if not match:
                break
            old_start, new_start = int(match.group(1)), int(match.group(3))
            old_len = int(match.group(2)) if match.group(2) is not None else 1
            new_len = int(match.group(4)) if match.group(4) is not None else 1
            body: List[Tuple[str, str]] = []
            index += 1
            seen_old = seen_new = 0
            while index < len(lines) and (seen_old < old_len or seen_new < new_len):
                raw = lines[index]
                tag = raw[:1]
                if tag == "\\":
                    if body:
                        body[-1] = (body[-1][0], body[-1][1].rstrip("\n"))
                    index += 1
                    continue
                if raw in ("\n", "\r\n"):
                    tag, raw = " ", " " + raw
                if tag not in (" ", "-", "+"):
                    break
                body.append((tag, raw[1:]))
                seen_old += tag in (" ", "-")
                seen_new += tag in (" ", "+")
                index += 1
            if index < len(lines) and lines[index].startswith("\\"):
                if body:
                    body[-1] = (body[-1][0], body[-1][1].rstrip("\n"))
                index += 1
            if (seen_old, seen_new) != (old_len, new_len):
                raise OverlayError("E301", "%s: hunk %d of %s is truncated or malformed (expected "
                                   "-%d +%d lines); regenerate the patch"
                                   % (patch_name, len(current.hunks) + 1, current.path,
                                      old_len, new_len))
            current.hunks.append((old_start, old_len, new_start, new_len, body))
        if not current.hunks:
            raise OverlayError("E301", "%s: %s has file headers but no hunk; nothing was written: "
                               "regenerate the patch" % (patch_name, current.path))
    header_only(git)
    if not patches:
        raise OverlayError("E301", "%s holds no unified diff (no ---/+++ file headers); pass a "
                           "patch made by `git diff` or `diff -u`" % patch_name)
    return patches


def git_mode_change(current: int, mode: int) -> int:
    """A file's permission bits after git's mode change to `mode` (0o755: the
    execute bits join the read bits, as `chmod +x`; 0o644: they go)."""
    bits = stat.S_IMODE(current)
    return bits | ((bits & 0o444) >> 2) if mode & 0o111 else bits & ~0o111


def apply_hunks(file_patch: FilePatch, original: Optional[bytes], patch_name: str) -> Optional[bytes]:
    """Result of the file's hunks on `original`, with exact context at the stated
    lines and no fuzz; None for a deleted file."""
    if file_patch.old is None and original is not None:
        raise OverlayError("E302", "%s: hunk 1 of %s creates a file that already exists; nothing "
                           "was written" % (patch_name, file_patch.path))
    if file_patch.old is not None and original is None:
        raise OverlayError("E302", "%s: hunk 1 of %s patches a file that does not exist; nothing "
                           "was written" % (patch_name, file_patch.path))
    text = (original or b"").decode("utf-8", "surrogateescape")
    lines = split_lines(text)
    result: List[str] = []
    cursor = 0
    for number, (old_start, old_len, _new_start, _new_len, body) in enumerate(file_patch.hunks, 1):
        expected = [content for tag, content in body if tag in (" ", "-")]
        position = old_start if old_len == 0 else old_start - 1
        if position < cursor or lines[position:position + len(expected)] != expected:
            raise OverlayError("E302", "%s: hunk %d of %s (@@ -%d,%d @@) does not match the file "
                               "at line %d; nothing was written: regenerate the patch against "
                               "the current tree" % (patch_name, number, file_patch.path,
                                                      old_start, old_len, old_start))
        result.extend(lines[cursor:position])
        result.extend(content for tag, content in body if tag in (" ", "+"))
        cursor = position + len(expected)
    result.extend(lines[cursor:])
    if file_patch.new is None:
        if result:
            raise OverlayError("E302", "%s: %s is deleted by the patch but its hunks do not cover "
                               "the whole file; nothing was written" % (patch_name, file_patch.path))
        return None
    return "".join(result).encode("utf-8", "surrogateescape")


def package_chain(path: str, created: List[str]) -> Tuple[str, str, bool]:
    """The module a .py file is by its package chain: its directory and each
    one above it while it holds an __init__.py (on disk or created by the
    patch).  Returns (name, the directory the name imports from, whether the
    file is a package's __init__.py)."""
    directory, base = os.path.split(path)
    package = base == "__init__.py"
    parts = [] if package else [base[:-3]]
    while directory != os.path.dirname(directory) and (
            os.path.isfile(os.path.join(directory, "__init__.py"))
            or os.path.join(directory, "__init__.py") in created):
        parts.insert(0, os.path.basename(directory))
        directory = os.path.dirname(directory)
    return ".".join(parts), directory, package


# Run by the target interpreter (`--python`): for each .py file, the first
# candidate name under which that interpreter imports the file.  The chain
# name comes first, then each name its path ends with, shortest first (a
# namespace package above the chain, found through sys.path or an editable
# install's finder).  Specs are found the way import finds them, finder by
# finder and through each parent's search locations, without running any
# package's __init__.py.  The entry -c adds for the current directory is
# dropped: a program started elsewhere, or as a script, does not have it.
MODULE_PROBE = r'''
import json, keyword, os, sys, types

sys.path[:] = [entry for entry in sys.path if entry]


def find(name):
    spec, path = None, None
    parts = name.split(".")
    for count in range(1, len(parts) + 1):
        if count > 1:
            if spec is None or spec.submodule_search_locations is None:
                return None
            path = list(spec.submodule_search_locations)
        fullname = ".".join(parts[:count])
        spec = getattr(sys.modules.get(fullname), "__spec__", None)
        for finder in [] if spec is not None else sys.meta_path:
            try:
                spec = finder.find_spec(fullname, path)
            except Exception:
                spec = None
            if spec is not None:
                break
        if spec is not None and spec.submodule_search_locations is not None and \
                fullname not in sys.modules:
            # A namespace package below needs its parent in sys.modules: a
            # bare module that has the package's path, not its code.
            module = types.ModuleType(fullname)
            module.__spec__, module.__path__ = spec, spec.submodule_search_locations
            sys.modules[fullname] = module
    return spec


def candidates(file):
    names = [file["chain"]]
    parts = file["path"][:-3].split(os.sep)[1:]
    if parts[-1] == "__init__":
        parts.pop()
    for start in range(len(parts) - 1, -1, -1):
        if not parts[start].isidentifier() or keyword.iskeyword(parts[start]):
            break
        names.append(".".join(parts[start:]))
    return list(dict.fromkeys(names))


def imports(name, file):
    real = os.path.realpath(file["path"])
    if os.path.exists(real):
        spec = find(name)
        return spec is not None and spec.origin is not None and \
            os.path.realpath(spec.origin) == real
    home = os.path.dirname(os.path.dirname(real) if file["package"] else real)
    parent = name.rpartition(".")[0]
    locations = sys.path
    if parent:
        spec = find(parent)
        locations = list(spec and spec.submodule_search_locations or [])
    return home in [os.path.realpath(location) for location in locations]


answers = []
for file in json.loads(sys.argv[1]):
    tried = candidates(file)
    spec = find(file["chain"])
    answers.append({"name": next((name for name in tried if imports(name, file)), None),
                    "chain_from": spec and spec.has_location and spec.origin})
print(json.dumps(answers))
'''


def module_names(python: str, files: List[dict], state: State, patch_name: str) -> List[str]:
    """Each .py file's module name as `python` imports it (see MODULE_PROBE),
    or E111 naming the file and the fix."""
    env = dict(os.environ, PYTHONDONTWRITEBYTECODE="1")
    path = [entry for entry in env.get("PYTHONPATH", "").split(os.pathsep)
            if entry and os.path.abspath(entry) != state.site]  # not our own overlay
    env["PYTHONPATH"] = os.pathsep.join(path)
    probe = [{"path": file["path"], "chain": file["chain"], "package": file["package"]}
             for file in files]
    try:
        done = subprocess.run([python, "-c", MODULE_PROBE, json.dumps(probe)], env=env,
                              stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as exc:
        why = "it took over 60 s" if isinstance(exc, subprocess.TimeoutExpired) else exc.strerror
        raise UsageError("E102", "cannot run --python %s (%s); pass the interpreter that runs "
                         "the install" % (python, why))
    try:
        answers = json.loads(done.stdout.decode("utf-8", "replace").splitlines()[-1])
    except (IndexError, ValueError):
        last = (done.stderr.decode("utf-8", "replace").strip().splitlines() or ["no output"])[-1]
        raise UsageError("E102", "--python %s could not say which modules it imports (exit "
                         "%d: %s); pass the interpreter that runs the install"
                         % (python, done.returncode, last))
    names = []
    for file, answer in zip(files, answers):
        if answer["name"] is not None:
            names.append(answer["name"])
            continue
        chain, where = file["chain"], answer["chain_from"]
        if where and os.path.realpath(where) != os.path.realpath(file["path"]):
            raise OverlayError("E111", "%s: %s would be module %s, but %s imports %s from %s; "
                               "patch that copy (--root at the install), install this one "
                               "(pip install -e), or pass --python with the interpreter that "
                               "imports this one; nothing was written"
                               % (patch_name, file["path"], chain, python, chain, where))
        raise OverlayError("E111", "%s: %s is module %s, which %s cannot import (nor under a "
                           "longer name of its path); put %s on PYTHONPATH or install its "
                           "package, pass --python with the interpreter that runs it, or leave "
                           "the file out of the patch (a test or a script); nothing was written"
                           % (patch_name, file["path"], chain, python, file["home"]))
    return names


# ---------------------------------------------------------------- build products


def walk_tree(root: str, excluded: List[str],
              builds_only: bool = False) -> Iterator[Tuple[str, os.stat_result]]:
    """(path, lstat) of everything under `root`, top down in name order,
    never following a symlink; what cannot be read is left out.  An
    excluded path is not entered, so what lies under it is never reached: a
    look-up per entry is enough (a walk comparing each entry with every
    excluded path took hours for 50,000 backed-up products).  With
    `builds_only`, hidden folders and virtual environments are not entered
    either: no build writes its products there."""
    skipped = set(excluded)
    pending = [] if any(is_within(root, path) for path in excluded) else [root]
    while pending:
        directory = pending.pop()
        try:
            with os.scandir(directory) as iterator:
                items = sorted(iterator, key=lambda item: item.name)
        except OSError:
            continue
        folders = []
        for item in items:
            if item.path in skipped or is_claim(item.name):
                continue
            try:
                st = item.stat(follow_symlinks=False)
            except OSError:
                continue
            if stat.S_ISDIR(st.st_mode):
                if builds_only and (item.name.startswith(".") or
                                    os.path.isfile(os.path.join(item.path, "pyvenv.cfg"))):
                    continue
                folders.append(item.path)
            yield item.path, st
        pending += reversed(folders)


def scan_tree(root: str, excluded: List[str]) -> Tuple[Dict[str, list], bool]:
    """{path: [kind, size, mtime_ns]} under `root`, bounded to SCAN_LIMIT entries."""
    found: Dict[str, list] = {}
    for path, st in walk_tree(root, excluded):
        if len(found) >= SCAN_LIMIT:
            return found, True
        kind = "d" if stat.S_ISDIR(st.st_mode) else "l" if stat.S_ISLNK(st.st_mode) else "f"
        found[path] = [kind, 0 if kind == "d" else st.st_size, st.st_mtime_ns]
    return found, False


def scan_exclusions(state: State, entry: dict) -> List[str]:
    # A repository's own folder is no build product: git rewrites .git/index
    # when a build stamps its version with `git describe --dirty`.
    return ([os.path.realpath(state.root), state.root]
            + [record["path"] for record in entry_files(entry)]
            + [cache["path"] for cache in entry["caches"]]
            + [os.path.join(tree, name) for tree in build_trees(entry.get("build"))
               for name in VCS_FOLDERS])


def prebuild_scan(state: State, entry: dict, key: str = "scan") -> Optional[dict]:
    """What the build directory held before the first build ("scan") or the
    latest one ("build_scan"); None when unknown (an empty one is known)."""
    if not entry.get(key) or not entry.get("build"):
        return None
    try:
        with open(state.state_path(entry[key]), encoding="utf-8") as handle:
            found = json.load(handle)
    except (OSError, ValueError):
        return None
    return found if isinstance(found, dict) else None


def build_trees(build: Optional[dict]) -> List[str]:
    """The directories a build writes into (build_directories, or --build-dir).
    A file written beside `make -C pkg` (an optimizer's results) is no
    product of it.  A journal of version 1.0 has one "tree" at most."""
    if not build:
        return []
    if build.get("trees"):
        return build["trees"]
    return [build["tree"]] if build.get("tree") else [build["cwd"]]


def cannot_tell(words: str, why: str = "names a directory only the shell knows") -> OverlayError:
    return OverlayError("E123", "cannot tell where the build command writes: `%s` %s; nothing "
                        "was changed: pass --build-dir DIR for each directory it writes in "
                        "(repeatable)" % (words, why))


def shell_words(command: str) -> List[str]:
    """The words and operators of a shell command line, each $(...) and
    `...` replaced by one word that stands for what only the shell knows."""
    previous = None
    while previous != command:
        previous = command
        command = re.sub(r"\$\([^()]*\)|`[^`]*`", "$(...)", command)
    lexer = shlex.shlex(command.replace("$(...)", SUBSTITUTION), posix=True,
                        punctuation_chars=True)
    lexer.whitespace_split = True
    words = []
    for word in lexer:
        if word and all(char in "();<>|&" for char in word):
            words += re.findall(r"&&|\|\||;;|\|&|[<>]+&?|[();&|]", word)
        else:
            words.append(word)
    return words


def build_directories(command: str, cwd: str, found: Optional[List[str]] = None) -> List[str]:
    """The directories the build command works in, as the shell runs it:
    each simple command runs where the `cd`, `pushd` and `popd` before it
    (a subshell's own) left it, after the wrapper words of WRAPPERS; make and
    ninja in their -C/--directory, `cmake --build` in its directory, an
    install in its prefix (DESTDIR=, PREFIX=, --prefix).  A script is taken
    to write where it runs, a `sh -c` string is read the same way.  Where a
    directory is known only to the shell ($VAR, $(...), `cd -`, eval):
    E123."""
    found = [] if found is None else found
    here, subshells, pushed = cwd, [], []
    simple: List[str] = []
    redirected = False
    try:
        words = shell_words(command)
    except ValueError as exc:  # an unclosed quote
        raise cannot_tell(command, "cannot be read as the shell reads it (%s)"
                          % str(exc).lower())
    for word in words + [";"]:
        if redirected:  # a redirection's target: no part of the command
            redirected = False
        elif word[:1] in ("<", ">"):
            redirected = True
        elif word in ("(", ")", ";", "&", "&&", "||", "|", "|&", ";;"):
            if simple:
                here = run_directories(simple, here, pushed, found)
            simple = []
            if word == "(":
                subshells.append(here)
            elif word == ")" and subshells:
                here = subshells.pop()
        else:
            simple.append(word)
    return found


def run_directories(words: List[str], here: str, pushed: List[str], found: List[str]) -> str:
    """Add the directories the simple command `words`, run in `here`, writes
    in to `found`; return the directory the next one runs in."""
    shown = " ".join(words).replace(SUBSTITUTION, "$(...)")

    def place(word: str, base: str) -> str:
        word = re.sub(r"\$(PWD\b|\{PWD\})", lambda _: here, word)
        word = os.path.expanduser(re.sub(
            r"\$(\w+|\{(\w+)\})", lambda m: os.environ.get(m.group(2) or m.group(1), m.group(0)),
            word))
        if any(char in word for char in "$`*?["):
            raise cannot_tell(shown)
        return os.path.normpath(os.path.join(base, word))

    def add(directory: str) -> None:
        if directory not in found:
            found.append(directory)

    while words and (words[0] in SHELL_KEYWORDS or re.match(r"^[A-Za-z_][A-Za-z0-9_]*=", words[0])):
        words = words[1:]
    while words and os.path.basename(words[0]) in WRAPPERS:
        name = os.path.basename(words[0])
        valued, operands = WRAPPERS[name]
        words = words[1:]
        while words and words[0].startswith("-") and len(words[0]) > 1:
            option = words.pop(0)
            if option == "--":
                break
            if name == "env" and option in ("-C", "--chdir") and words:
                here = place(words.pop(0), here)
            elif option in valued and words:
                words.pop(0)
        while name == "env" and words and re.match(r"^[A-Za-z_][A-Za-z0-9_]*=", words[0]):
            words = words[1:]
        words = words[operands:]
    if not words:
        return here
    name = os.path.basename(words[0])
    operands = [word for word in words[1:] if not word.startswith("-") or word == "-"]
    if name in ("cd", "pushd"):
        if not operands or operands[0] == "-":
            raise cannot_tell(shown)
        if name == "pushd":
            pushed.append(here)
        return place(operands[0], here)
    if name == "popd":
        if not pushed:
            raise cannot_tell(shown)
        return pushed.pop()
    if name in ("eval", "source", "."):
        raise cannot_tell(shown)
    if name in ("sh", "bash", "dash", "zsh") and "-c" in words[1:-1]:
        build_directories(words[words.index("-c") + 1], here, found)
        return here
    directory = here
    for number, word in enumerate(words[1:], 1):
        value = words[number + 1] if number + 1 < len(words) else None
        if name in ("make", "gmake", "ninja", "ninja-build") and word in ("-C", "--directory") \
                and value is not None:
            directory = place(value, directory)
        elif name in ("make", "gmake") and re.match(r"^(-C|--directory=).", word):
            directory = place(re.sub(r"^(-C|--directory=)", "", word), directory)
        elif name == "cmake" and word in ("--build", "-B") and value is not None:
            directory = place(value, here)
        elif re.match(r"^(DESTDIR|PREFIX|prefix|--prefix)=.", word):
            add(place(word.split("=", 1)[1], here))
        elif word == "--prefix" and value is not None:
            add(place(value, here))
    add(directory)
    return here


def scan_build(state: State, entry: dict) -> Tuple[Dict[str, list], bool]:
    found: Dict[str, list] = {}
    truncated = False
    for tree in build_trees(entry["build"]):
        part, cut = scan_tree(tree, scan_exclusions(state, entry))
        found.update(part)
        truncated = truncated or cut
    return found, truncated


def restore_build_dir_mtimes(state: State, entry: dict) -> None:
    """Directories of the build directory get their mtimes back: a build
    makes and removes files where nothing is tracked (CMake's Progress
    folder), and removing its products touches their directories."""
    trees = build_trees(entry.get("build"))
    for path, info in sorted((prebuild_scan(state, entry) or {}).items(), reverse=True):
        if (isinstance(info, list) and len(info) == 3 and info[0] == "d"
                and type(info[2]) is int and info[2]
                and any(is_within(path, tree) for tree in trees)
                and os.path.isdir(path) and not os.path.islink(path)
                and os.lstat(path).st_mtime_ns != info[2]):
            os.utime(path, ns=(info[2], info[2]), follow_symlinks=False)


def untracked_products(state: State, entry: dict) -> List[dict]:
    """Files and directories that the entry's builds created, rewrote or
    deleted and that nothing tracks: as recorded after its last build, else
    (the run died in a build) what changed since the scan before that build,
    with what earlier builds of the entry recorded."""
    if entry.get("untracked") is not None:
        return entry["untracked"]
    before = prebuild_scan(state, entry, "build_scan")
    if before is None:
        before = prebuild_scan(state, entry)
    if before is None:
        return entry.get("earlier_untracked") or []
    after, _ = scan_build(state, entry)
    products = []
    for path, info in sorted(after.items()):
        old = before.get(path)
        if old is None:
            products.append({"path": path, "kind": info[0], "created": True})
        elif info[0] != "d" and old[:3] != info and scanned_link(old) is None:
            products.append({"path": path, "kind": info[0], "created": False})
    excluded = set(scan_exclusions(state, entry))  # backed up since the scan, or the state's
    for path, old in sorted(before.items()):
        if path not in after and isinstance(old, list) and old and old[0] in ("f", "d") and \
                path not in excluded:  # a folder is made again, as empty as CMake's scratch
            products.append({"path": path, "kind": old[0], "created": False, "deleted": True})
    return merge_products(entry.get("earlier_untracked") or [], products)


def merge_products(earlier: List[dict], later: List[dict]) -> List[dict]:
    """What all builds of an entry made: a file the first build created
    stays created when an update rebuilds it.  Where an update built a thing
    of another kind in place of what was there before the first build (a
    folder where it deleted a file), both records stay: revert removes the
    new one and names the lost one."""
    merged = {product["path"]: [product] for product in later}
    for product in earlier:
        now = merged.setdefault(product["path"], [])
        if not now:
            now.append(product)
        elif now[0]["kind"] == product["kind"] or product["created"]:
            now[0] = dict(now[0], created=product["created"])
        else:
            now.append(product)
    return [product for path in sorted(merged) for product in merged[path]]


def seen(path: str) -> Optional[list]:
    """The identity of what is at `path` now (None: nothing).  The same
    identity later proves that nobody wrote, replaced or removed it since:
    any write, rename or chmod sets a new ctime, which nobody can set back."""
    try:
        return file_identity(path)
    except (FileNotFoundError, NotADirectoryError):
        return None


def scanned_link(info: object) -> Optional[str]:
    """The target of a symlink as the pre-build scan recorded it, else None."""
    if isinstance(info, list) and len(info) == 4 and info[0] == "l" and \
            type(info[2]) is int and isinstance(info[3], str):
        return info[3]
    return None


def moved_links(state: State, entry: dict) -> List[Tuple[str, str, int]]:
    """The symlinks of the build directory that are no longer as the scan
    before the first build saw them (path, target, mtime); someone's
    directory standing there now is left out."""
    trees = build_trees(entry.get("build"))
    moved = []
    for path, info in sorted((prebuild_scan(state, entry) or {}).items()):
        target = scanned_link(info)
        if target is None or path != os.path.normpath(path) or \
                not any(is_within(path, tree) for tree in trees):
            continue
        try:
            st = os.lstat(path)
        except (FileNotFoundError, NotADirectoryError):
            st = None
        if st is None or not (stat.S_ISDIR(st.st_mode) or (
                stat.S_ISLNK(st.st_mode) and st.st_mtime_ns == info[2]
                and os.readlink(path) == target)):
            moved.append((path, target, info[2]))
    return moved


def changed_links(state: State, entry: dict) -> Dict[str, Optional[list]]:
    """After a build: the links it changed, with what it left there."""
    return {path: seen(path) for path, _, _ in moved_links(state, entry)}


def restore_build_dir_links(state: State, entry: dict, force: bool) -> List[str]:
    """Symlinks of the build directory come back with their target and mtime:
    a link step makes a library's links (libk.so -> libk.so.1.2) anew, and
    no rule names them, so a build after revert would not make them again.
    A link changed or removed after the build is someone's: it is kept, and
    returned."""
    left = entry.get("links_seen")  # None: the run died in its build
    kept = []
    for path, target, mtime_ns in moved_links(state, entry):
        if left is not None and not force and (path not in left or seen(path) != left[path]):
            kept.append(path)
            continue
        put_symlink(path, target, mtime_ns)
    return kept


# ---------------------------------------------------------------- what the build will rewrite


def build_tool(command: str, cwd: str) -> Optional[Tuple[str, List[str], str]]:
    """('make', argv, directory) or ('ninja', argv, directory) when the build
    command is one plain call of make, ninja or `cmake --build DIR` (leading
    VAR=value words allowed); None for anything else (a shell pipeline, a
    setup.py, a script)."""
    try:
        words = shlex.split(command)
    except ValueError:
        return None
    while words and re.match(r"^[A-Za-z_][A-Za-z0-9_]*=", words[0]):
        words = words[1:]
    if not words or any(word in ("&&", "||", ";", "|", "&", ">", "<") or word.endswith(";")
                        for word in words):
        return None
    if os.path.basename(words[0]) in BUILD_TOOLS and any("$" in word or "`" in word
                                                         for word in words):
        words = expanded_words(command, words)  # make -j$(nproc), ninja -C "$BUILD"
        if words is None:
            return None
    name = os.path.basename(words[0])
    if name in ("make", "gmake", "ninja", "ninja-build"):
        directory = cwd
        for number, word in enumerate(words[1:-1], 1):
            if word == "-C":
                directory = os.path.normpath(os.path.join(directory, words[number + 1]))
        return "ninja" if name.startswith("ninja") else "make", words, directory
    if name == "cmake" and len(words) >= 3 and words[1] == "--build":
        directory = os.path.normpath(os.path.join(cwd, words[2]))
        cache = cmake_cache(directory)
        targets = [words[i + 1] for i in range(len(words) - 1) if words[i] in ("--target", "-t")]
        generator = cache.get("CMAKE_GENERATOR")
        program = cache.get("CMAKE_MAKE_PROGRAM")
        if generator == "Ninja":
            return "ninja", [program or "ninja", "-C", directory] + targets, directory
        if generator == "Unix Makefiles":
            return "make", [program or "make", "-C", directory] + targets, directory
    return None


def expanded_words(command: str, words: List[str]) -> Optional[List[str]]:
    """The words of a build command as its shell will see them, worked out
    without running any of it (a plan must change nothing): a job count from
    a command substitution is dropped (the plan is asked with -j1 anyway),
    and $VAR / ${VAR} come from this environment, which the build inherits.
    None for anything else: another substitution, a variable that is not
    set, a `$` in single quotes (literal to the shell)."""
    if "'" in command:
        return None
    kept: List[str] = []
    for word in words:
        if re.match(r"^(-j|--jobs=)(\$\(.*\)|`.*`)$", word):
            continue
        if re.match(r"^(\$\(.*\)|`.*`)$", word) and kept[-1:] == ["-j"]:
            kept.pop()
            continue
        if "`" in word or "$(" in word:
            return None
        word = os.path.expandvars(word)
        if "$" in word:
            return None
        kept.append(word)
    return kept

def cmake_cache(directory: str) -> Dict[str, str]:
    """NAME -> value of a CMakeCache.txt (empty when there is none)."""
    values = {}
    try:
        with open(os.path.join(directory, "CMakeCache.txt"), encoding="utf-8",
                  errors="replace") as handle:
            for line in handle:
                match = re.match(r"^([A-Za-z_][A-Za-z0-9_]*):[A-Z]+=(.*)$", line.rstrip("\n"))
                if match:
                    values[match.group(1)] = match.group(2)
    except OSError:
        pass
    return values


def ask_build_tool(argv: List[str], cwd: str) -> Optional[str]:
    """The output of a dry-run query of the build tool, or None if it failed."""
    try:
        result = subprocess.run(argv, cwd=cwd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, timeout=PREDICT_TIMEOUT,
                                env=dict(os.environ, LC_ALL="C"))
    except (OSError, subprocess.TimeoutExpired):
        return None
    if result.returncode != 0:
        return None
    return result.stdout.decode("utf-8", "surrogateescape")


def make_targets(argv: List[str], cwd: str, sources: List[str]) -> Optional[List[str]]:
    """Every target make would remake if `sources` changed: `make -n --trace`
    with -W (what-if) for each source, by each name a make may know it by
    (what_if_names).  make does not pass -W down to sub-makes,
    so MAKE is redefined to carry it (as CMake's Makefiles need); their
    targets are placed through the 'Entering directory' lines.  make -n still
    runs recipes that use $(MAKE) or start with '+', as it always does."""
    directory = cwd
    for number, word in enumerate(argv[1:-1], 1):
        if word == "-C":
            directory = os.path.normpath(os.path.join(directory, argv[number + 1]))
    # A header reaches make's rules only through the compiler's depfiles,
    # which CMake's Makefiles read in a step that -n skips: the objects whose
    # depfile names a source are changed as well.
    readers = depfile_readers(directory, sources)
    what_if = []
    for source in sources + readers:
        for name in what_if_names(source, directory):
            what_if += ["-W", name]
    sub_make = " ".join(shlex.quote(word) for word in [argv[0]] + what_if)
    output = ask_build_tool(argv + ["-n", "-w", "--trace", "-j1"] + what_if
                            + ["MAKE=" + sub_make], cwd)
    if output is None:
        return None
    directories = [cwd]
    targets = list(readers)
    for line in output.splitlines():
        entering = re.match(r"^\S+: Entering directory '(.*)'$", line)
        if entering:
            directories.append(entering.group(1))
            continue
        if re.match(r"^\S+: Leaving directory '.*'$", line) and len(directories) > 1:
            directories.pop()
            continue
        target = re.match(r"^(?:\S+:\d+: )?(?:update target '(.*)' due to|target '(.*)' does "
                          r"not exist)", line)
        if target:
            name = target.group(1) if target.group(1) is not None else target.group(2)
            targets.append(os.path.normpath(os.path.join(directories[-1], name)))
    return targets


def what_if_names(source: str, cwd: str) -> List[str]:
    """The names a make in `cwd` or a sub-make below it may give `source`:
    absolute, and relative to `cwd` and to each directory between it and the
    source (`$(MAKE) -C kernels` reads kernels/k.c as k.c).  A name that is
    no target of a make is ignored by its -W."""
    names = [source]
    directory = os.path.dirname(source)
    while is_within(directory, cwd):
        names.append(os.path.relpath(source, directory))
        if directory == cwd:
            break
        directory = os.path.dirname(directory)
    if not is_within(source, cwd):
        names.append(os.path.relpath(source, cwd))
    return names


def depfile_readers(directory: str, sources: List[str]) -> List[str]:
    """The targets of the compiler depfiles (*.d) under `directory` that list
    one of `sources` as a dependency (names relative to `directory`)."""
    found: List[str] = []
    wanted = set(sources)
    for path, st in walk_tree(directory, [], builds_only=True):
        if not path.endswith(".d") or not stat.S_ISREG(st.st_mode) or \
                st.st_size > DEPFILE_LIMIT:
            continue
        with open(path, encoding="utf-8", errors="surrogateescape") as handle:
            text = handle.read().replace("\\\n", " ")
        for line in text.splitlines():
            targets, colon, deps = line.partition(": ")
            if colon and any(os.path.normpath(os.path.join(directory, dep)) in wanted
                             for dep in deps.split()):
                found += [os.path.normpath(os.path.join(directory, target))
                          for target in targets.split() if target]
    return found


@contextlib.contextmanager
def ninja_copy(directory: str):
    """A folder that stands for the build directory in ninja's queries: its
    logs copied, everything else linked.  Every ninja run rewrites the logs
    it reads (an older log format converted; one it finds too old or too new,
    as another ninja wrote it, deleted), and asking for the plan must not."""
    folder = tempfile.mkdtemp(prefix="overlay-ninja-")
    try:
        for name in os.listdir(directory):
            path = os.path.join(directory, name)
            if name in (".ninja_log", ".ninja_deps") and os.path.isfile(path):
                shutil.copy2(path, os.path.join(folder, name))
            else:
                os.symlink(path, os.path.join(folder, name))
        yield folder
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def ninja_targets(argv: List[str], directory: str, sources: List[str]) -> Optional[List[str]]:
    """Every output that depends on one of `sources` in ninja's graph: the
    edges that read a node (`ninja -t query`) and the header dependencies
    ninja recorded (`ninja -t deps`) or the depfiles on disk hold, followed to
    the end; then .ninja_log and .ninja_deps, which every ninja run rewrites.
    ninja is asked in a copy of the build directory (ninja_copy)."""
    try:
        with ninja_copy(directory) as copy:
            return ninja_query(argv, directory, copy, sources)
    except OSError:
        return None


def ninja_query(argv: List[str], directory: str, copy: str,
                sources: List[str]) -> Optional[List[str]]:
    base = [argv[0], "-C", copy]
    for number, word in enumerate(argv[:-1]):
        if word == "-f":
            base += ["-f", argv[number + 1]]
    listing = ask_build_tool(base + ["-t", "deps"], directory)
    if listing is None:
        return None
    readers: Dict[str, List[str]] = {}
    output = None
    for line in listing.splitlines():
        if line and not line[0].isspace():
            output = line.split(": #deps", 1)[0]
        elif line.strip() and output is not None:
            readers.setdefault(line.strip(), []).append(output)
    # A rule with a depfile but no `deps =` leaves its header dependencies in
    # the depfiles on disk, where `-t deps` does not look.
    frontier = {os.path.relpath(target, directory)
                for target in depfile_readers(directory, sources)}
    found = sorted(frontier)
    for source in sources:
        for name in (source, os.path.relpath(source, directory)):
            if name in readers or ask_build_tool(base + ["-t", "query", name], directory):
                frontier.add(name)
    seen: set = set()
    while frontier:
        batch = sorted(frontier - seen)
        seen.update(batch)
        frontier = set()
        for name in batch:
            frontier.update(readers.get(name, []))
        answer = ask_build_tool(base + ["-t", "query"] + batch, directory) if batch else ""
        if answer is None:
            return None
        section = None
        for line in answer.splitlines():
            if line.startswith("  ") and not line.startswith("    "):
                section = line.strip()
            elif line.startswith("    ") and section == "outputs:":
                frontier.add(line.strip())
        found += sorted(frontier - seen)
    return [os.path.normpath(os.path.join(directory, name)) for name in found] + [
        os.path.join(directory, ".ninja_log"), os.path.join(directory, ".ninja_deps")]


def product_files(cwd: str, excluded: List[str]) -> List[str]:
    """The build products (build_product) already in the build directory."""
    return [path for path, st in walk_tree(cwd, excluded, builds_only=True)
            if not stat.S_ISDIR(st.st_mode) and build_product(path, [cwd])]


def side_products(target: str) -> List[str]:
    """A target and what writing it rewrites besides, that no rule names: the
    depfile of a compiler run with -MD (x.d for x.o, x.o.d as CMake and
    ninja's $out.d name it), and the dependency state CMake's Makefiles keep
    beside the objects of a target (CMakeFiles/<target>.dir)."""
    found = [target, os.path.splitext(target)[0] + ".d", target + ".d"]
    directory = os.path.dirname(target)
    if directory.endswith(".dir") and os.path.basename(os.path.dirname(directory)) == "CMakeFiles":
        found += [os.path.join(directory, name) for name in CMAKE_DEPEND_STATE]
    return found


def asks_make(build: Optional[dict]) -> bool:
    """Whether the build's products come from make's plan: make -n -W
    evaluates the Makefile's $(shell ...) (only recipes are not run), so it is
    asked only once the entry is journaled, and never by --dry-run."""
    tool = build_tool(build["cmd"], build["cwd"]) if build is not None else None
    return tool is not None and tool[0] == "make"


def predict_products(build: dict, sources: List[str], excluded: List[str],
                     ask_make: bool = True) -> List[Tuple[str, str]]:
    """[(path, how it was found)] of the existing regular files the build
    may rewrite (nothing of make's for a make build when not `ask_make`)."""
    tool = build_tool(build["cmd"], build["cwd"])
    if tool is None and os.path.isfile(os.path.join(build["cwd"], "build.ninja")):
        # A command that runs ninja there itself: an import that triggers
        # torch's JIT, a setup.py (what --no-build gets for such a folder).
        tool = ("ninja", ["ninja"], build["cwd"])
    predicted = None
    how = "found in the build directory"
    if tool is not None:
        kind, argv, directory = tool
        if kind == "make" and not ask_make:
            predicted = []
        elif kind == "make":
            predicted = make_targets(argv, build["cwd"], sources)
            how = "predicted by make -n -W"
        else:
            predicted = ninja_targets(argv, directory, sources)
            how = "predicted from ninja's graph"
        if predicted is None:
            how = "found in the build directory (asking %s failed)" % kind
    trees = build_trees(build)
    if predicted is None:
        predicted = product_files(trees[0], excluded)
    found = [(target, how) for target in predicted]
    for tree in trees[1:] if tool is None else [tree for tree in trees if tree != tool[2]]:
        # an install's prefix, a second build folder
        found += [(target, "found in the build directory") for target in
                  product_files(tree, excluded)]
    paths = []
    seen = set()
    for path, how in [(name, how) for target, how in found for name in side_products(target)]:
        if path not in seen and not any(is_within(path, other) for other in excluded) and \
                os.path.isfile(path) and not os.path.islink(path):
            paths.append((path, how))
            seen.add(path)
    return paths


def installed_distribution(path: str) -> Optional[str]:
    """The dist-info folder of the installed distribution that owns `path`:
    the first one, walking up from it, whose RECORD lists it; else None."""
    directory = os.path.dirname(path)
    while True:
        try:
            names = sorted(name for name in os.listdir(directory) if name.endswith(".dist-info"))
        except OSError:
            names = []
        for name in names:
            if path in distribution_files(os.path.join(directory, name)):
                return os.path.join(directory, name)
        if os.path.dirname(directory) == directory:
            return None
        directory = os.path.dirname(directory)


def artifact_distributions(artifacts: List[str], caches: List[str]) -> List[str]:
    """The dist-info folders of the installed distributions that own an
    artifact outside the caches."""
    return sorted({dist_info for dist_info in map(installed_distribution, [
        path for path in artifacts if not any(is_within(path, cache) for cache in caches)])
                   if dist_info})


def distribution_files(dist_info: str) -> List[str]:
    """The files an installed distribution owns, as pip's RECORD names them
    (one line per file, its path from the folder that holds the dist-info,
    then its hash and size), and the files of its dist-info folder."""
    site = os.path.dirname(dist_info)
    try:
        with open(os.path.join(dist_info, "RECORD"), encoding="utf-8", newline="") as handle:
            rows = list(csv.reader(handle.read(INPUT_LIMIT).splitlines()))
    except (OSError, UnicodeDecodeError, csv.Error):
        rows = []
    listed = {os.path.normpath(os.path.join(site, row[0])) for row in rows if row and row[0]}
    listed.update(path for path, st in walk_tree(dist_info, []) if stat.S_ISREG(st.st_mode))
    return sorted(listed)


def distribution_trees(dist_info: str) -> List[str]:
    """The folders a distribution installs into its site folder, and its
    dist-info: where a reinstall of it creates and deletes files."""
    site = os.path.dirname(dist_info)
    return sorted({os.path.join(site, os.path.relpath(path, site).split(os.sep)[0])
                   for path in distribution_files(dist_info)
                   if is_within(path, site) and os.path.dirname(path) != site})


def replaces_files(build: Optional[dict]) -> bool:
    """Whether the build installs by pip (or uv), which writes each file of a
    distribution anew and renames or unlinks the old one: what it replaces
    is kept by a hard link, which nothing writes through."""
    return build is not None and bool(re.search(r"(^|[\s/])(pip3?|uv)(\.exe)?\s+(\S+\s+)*install\b"
                                                r"|-m\s+pip\s", build["cmd"]))


def links_distribution(state: State, build: Optional[dict], dist_info: str) -> bool:
    """Whether the files of an installed distribution are kept by hard links
    (the build replaces them, and the state shares their mount)."""
    return replaces_files(build) and mount_of(state.root) == mount_of(dist_info)


def protected_paths(state: State, sources: List[str], artifacts: List[str], caches: List[str],
                    build: Optional[dict], protect: List[str],
                    no_protect: bool, ask_make: bool = True) -> List[Tuple[str, str]]:
    """[(path, why)] of the existing files to back up besides sources and
    artifacts, so that revert gives back what the build rewrites.  The
    automatic part is refused over PROTECT_BUDGET before anything changes."""
    excluded = sources + artifacts + caches + [state.root, os.path.realpath(state.root)]
    chosen: List[Tuple[str, str]] = []
    taken = set()  # the paths in chosen and predicted: a look-up, not a pass over them
    for path in protect:
        files = [path]
        if os.path.isdir(path):
            files = sorted(name for name, st in walk_tree(path, []) if stat.S_ISREG(st.st_mode))
        for name in files:
            if name not in excluded and name not in taken:
                chosen.append((name, "--protect"))
                taken.add(name)
    if no_protect:
        return chosen
    copied: List[Tuple[str, str]] = []
    for dist_info in (build or {}).get("distributions") or []:
        why = DISTRIBUTION_WHY % os.path.basename(dist_info)
        for path in distribution_files(dist_info):
            if path not in excluded and path not in taken and os.path.isfile(path) and \
                    not os.path.islink(path):
                (chosen if links_distribution(state, build, dist_info) else copied).append(
                    (path, why))
                taken.add(path)
    # A JIT at import (torch's extension loader runs ninja in the artifact's
    # folder), after --no-build or as the build command, rewrites what the
    # build.ninja beside the artifact says.
    builds = ([build] if build is not None else []) + [
        {"cmd": "ninja", "cwd": directory} for directory in jit_directories(artifacts, build)]
    predicted = copied  # a copy of each counts against the budget; a hard link costs nothing
    for one in builds:
        found = predict_products(one, sources, excluded, ask_make)
        predicted += [(path, how) for path, how in found if path not in taken]
        taken.update(path for path, _ in found)
    size = sum(os.lstat(path).st_size for path, _ in predicted)
    if size > PROTECT_BUDGET:
        raise OverlayError("E110", "backing up the %d existing build product(s) the build may "
                           "rewrite (%s) takes %d MiB, over the budget of %d MiB; nothing was "
                           "changed: pass --no-protect to accept that revert leaves them rebuilt, "
                           "with --protect PATH for those to keep byte-exact"
                           % (len(predicted), predicted[0][1], size >> 20, PROTECT_BUDGET >> 20))
    return chosen + predicted


def jit_directories(artifacts: List[str], build: Optional[dict]) -> List[str]:
    """The folders of artifacts that hold a build.ninja, outside the build's
    own directories: a JIT's build directory (torch's extension cache)."""
    return sorted({os.path.dirname(path) for path in artifacts
                   if os.path.isfile(os.path.join(os.path.dirname(path), "build.ninja"))
                   and not any(is_within(path, tree) for tree in build_trees(build))})


def build_candidates(sources: List[str]) -> List[Tuple[str, str]]:
    """[(suggested options, what was found)] walking up from each source:
    build systems and JIT caches to suggest, never to run."""
    found: List[Tuple[str, str]] = []
    def add(option: str, why: str) -> None:
        if all(option != other for other, _ in found):
            found.append((option, why))
    for source in sources:
        directory = os.path.dirname(source)
        while True:
            places = [directory] + sorted(
                os.path.join(directory, name) for name in os.listdir(directory)
                if name.startswith("build") and os.path.isdir(os.path.join(directory, name))) \
                if os.access(directory, os.R_OK | os.X_OK) else [directory]
            for place in places:
                quoted = shell_quote(place)
                if os.path.isfile(os.path.join(place, "CMakeCache.txt")):
                    add("--build-cmd 'cmake --build %s' --build-cwd %s" % (quoted, quoted),
                        os.path.join(place, "CMakeCache.txt"))
                if os.path.isfile(os.path.join(place, "build.ninja")):
                    add("--build-cmd ninja --build-cwd %s" % quoted,
                        os.path.join(place, "build.ninja"))
                if os.path.isfile(os.path.join(place, "Makefile")):
                    add("--build-cmd make --build-cwd %s" % quoted, os.path.join(place, "Makefile"))
            if os.path.isfile(os.path.join(directory, "setup.py")):
                add("--build-cmd 'python3 setup.py build_ext --inplace' --build-cwd %s"
                    % shell_quote(directory), os.path.join(directory, "setup.py"))
            elif os.path.isfile(os.path.join(directory, "pyproject.toml")):
                add("--build-cmd 'python3 -m pip install --no-build-isolation --no-deps -e .' "
                    "--build-cwd %s" % shell_quote(directory),
                    os.path.join(directory, "pyproject.toml"))
            parent = os.path.dirname(directory)
            if parent == directory:
                break
            directory = parent
    home = os.path.expanduser("~")
    for variable, default, what in (
            ("TORCH_EXTENSIONS_DIR", os.path.join(home, ".cache", "torch_extensions"),
             "torch extension build cache"),
            ("TRITON_CACHE_DIR", os.path.join(home, ".triton", "cache"), "Triton JIT cache")):
        cache = os.environ.get(variable) or default
        if os.path.isdir(cache):
            add("--invalidate-cache %s" % shell_quote(cache), what)
    return found


# ---------------------------------------------------------------- tar snapshots


def snapshot_cache(cache: str, archive: str) -> None:
    """A tar snapshot of a cache directory, with modes, ns mtimes and symlinks."""
    mutation_point()
    write_point(archive)
    tmp = temp_beside(archive)
    with tarfile.open(tmp, "w", format=tarfile.PAX_FORMAT) as tar:
        for path in [cache] + [path for path, _ in walk_tree(cache, [])]:
            arcname = os.path.relpath(path, cache)
            info = tar.gettarinfo(path, arcname)
            # gettarinfo refuses only sockets; a fifo or device would be
            # archived, and then refused at revert (checked_members).
            if info is None or not (info.isreg() or info.isdir() or info.issym()
                                    or info.islnk()):
                raise OverlayError("E106", "cache %s holds %s, which is neither a file, a "
                                   "directory nor a symlink; clear it before the overlay"
                                   % (cache, path))
            info.pax_headers = {MTIME_KEY: str(os.lstat(path).st_mtime_ns)}
            if not info.issym():
                info.pax_headers.update((XATTR_KEY + name, value)
                                        for name, value in read_xattrs(path).items())
            if info.isreg():
                with open(path, "rb") as handle:
                    tar.addfile(info, handle)
            else:
                tar.addfile(info)
    with open(tmp, "rb") as handle:
        os.fsync(handle.fileno())
    os.replace(tmp, archive)
    fsync_dir(os.path.dirname(archive))


def unreadable_snapshot(archive: str, exc: Exception) -> OverlayError:
    return OverlayError("E502", "snapshot %s cannot be read (%s); nothing was restored from it: "
                        "rebuild the cache instead" % (archive, exc))


def open_snapshot(archive: str) -> tarfile.TarFile:
    try:
        return tarfile.open(archive, "r:")  # written uncompressed
    except (tarfile.TarError, EOFError, OSError) as exc:
        raise unreadable_snapshot(archive, exc)


def checked_members(archive: str, tar: tarfile.TarFile) -> List[tarfile.TarInfo]:
    """Every member, checked before anything is extracted: no absolute path
    or '..', no special file, every member inside a directory of the snapshot
    (never through one of its symlinks), every hard link to an earlier file
    of the snapshot by name.  A symlink may point anywhere (a virtualenv's
    python -> /usr/bin/python3): extract_snapshot makes links last, so
    nothing is ever written through one."""
    try:
        members = tar.getmembers()
    except (tarfile.TarError, EOFError, OSError) as exc:
        raise unreadable_snapshot(archive, exc)
    directories = {"."}
    files = set()  # regular files and symlinks, by normalised name
    symlinks = set()
    for member in members:
        name = member.name
        def refuse(why: str) -> OverlayError:
            return OverlayError("E502", "snapshot %s holds member %r, %s; nothing was restored "
                                "from it: the snapshot was tampered with, rebuild the cache "
                                "instead" % (archive, name, why))
        if name.startswith("/") or not name:
            raise refuse("an absolute path")
        if ".." in name.split("/"):
            raise refuse("a path with '..'")
        if not (member.isreg() or member.isdir() or member.issym() or member.islnk()):
            raise refuse("a device, fifo or other special file")
        if not member.pax_headers.get(MTIME_KEY, "0").lstrip("-").isdigit():
            raise refuse("an mtime that is no number")
        if not all(re.match(r"^([0-9a-f]{2})*$", value) for key, value in
                   member.pax_headers.items() if key.startswith(XATTR_KEY)):
            raise refuse("an extended attribute that is not hex")
        normal = os.path.normpath(name)
        parent = os.path.dirname(normal) or "."
        if parent not in directories:
            raise refuse("a path through a symlink" if any(
                is_within(parent, link) for link in symlinks)
                else "a path whose directory is not in the snapshot")
        if normal != "." and (normal in directories or normal in files):
            raise refuse("a second member of that name")
        if member.islnk() and os.path.normpath(member.linkname) not in files:
            raise refuse("a hard link to %r, which is no earlier file of the snapshot"
                         % member.linkname)
        (directories if member.isdir() else files).add(normal)
        if member.issym():
            symlinks.add(normal)
    return members


def extract_snapshot(archive: str, destination: str) -> None:
    """Extract into a fresh `destination` (must not exist): directories and
    files first, then symlinks and hard links in their order, so that nothing
    is written through a link of the snapshot."""
    with open_snapshot(archive) as tar:
        members = checked_members(archive, tar)
        mutation_point()
        os.mkdir(destination, 0o700)
        directories = []
        links = []
        for member in members:
            path = os.path.normpath(os.path.join(destination, member.name))
            if member.issym() or member.islnk():
                links.append((member, path))
            elif member.isdir():
                if path != destination:
                    os.mkdir(path, 0o700)
                directories.append((member, path))
            else:
                write_point(path)
                fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
                try:
                    write_holes_skipped(fd, tar.extractfile(member))
                    os.fsync(fd)
                finally:
                    os.close(fd)
                finish_member(member, path)
        for member, path in links:
            if member.islnk():  # the same inode as its target: owner, mode and all
                os.link(os.path.normpath(os.path.join(destination, member.linkname)), path,
                        follow_symlinks=False)
            else:
                os.symlink(member.linkname, path)
                finish_member(member, path)
        for member, path in reversed(directories):
            finish_member(member, path)
    fsync_dir(os.path.dirname(destination))


def write_holes_skipped(fd: int, source) -> None:
    """Write what `source` reads into the empty file `fd`, leaving each
    HOLE_UNIT of zeros unwritten, a hole: a sparse file in a snapshot (tar
    keeps its zeros) comes back as sparse as it was, not fully allocated."""
    offset = 0
    while True:
        block = source.read(CHUNK)
        if not block:
            break
        start = 0
        while start < len(block):
            end = start
            while end < len(block) and block[end:end + HOLE_UNIT] != ZEROS[:min(
                    HOLE_UNIT, len(block) - end)]:
                end += HOLE_UNIT  # a run of data, written in one go
            if end > start:
                os.lseek(fd, offset + start, os.SEEK_SET)
                _write_all(fd, block[start:end])
            start = end + HOLE_UNIT if end < len(block) else end
        offset += len(block)
    os.ftruncate(fd, offset)


def finish_member(member: tarfile.TarInfo, path: str) -> None:
    """An extracted member's metadata: as root its owner (as a rename would
    keep it), then its mode (chown clears set-id bits), extended attributes
    and ns mtime."""
    if os.geteuid() == 0:
        os.chown(path, member.uid, member.gid, follow_symlinks=False)
    if not member.issym():
        os.chmod(path, member.mode)
        for key, value in sorted(member.pax_headers.items()):
            if key.startswith(XATTR_KEY):
                os.setxattr(path, key[len(XATTR_KEY):], bytes.fromhex(value),
                            follow_symlinks=False)
    mtime = int(member.pax_headers.get(MTIME_KEY, int(member.mtime * 1e9)))
    os.utime(path, ns=(mtime, mtime), follow_symlinks=False)


# ---------------------------------------------------------------- native entries


def record_file(path: str, role: str) -> dict:
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return {"path": path, "role": role, "present": False, "backup": None}
    if not stat.S_ISREG(st.st_mode):
        raise OverlayError("E104", "%s %s is not a regular file (a symlink, directory or special "
                           "file); pass the file itself" % (role, path))
    return {"path": path, "role": role, "present": True, "backup": None,
            "mode": stat.S_IMODE(st.st_mode), "mtime_ns": st.st_mtime_ns,
            "atime_ns": st.st_atime_ns, "uid": st.st_uid, "gid": st.st_gid,
            "links": st.st_nlink, "xattrs": read_xattrs(path)}


def check_claims(state: State, sources: List[str], artifacts: List[str],
                 caches: List[str]) -> None:
    """A path that another applied state directory of this user holds (as a
    source, an artifact or a cache) is refused: reverted in the wrong order,
    one of the two would put the other's patch or build back."""
    wanted = [("--source", path) for path in sources] + [
        ("--artifact", path) for path in artifacts] + [
        ("--invalidate-cache", path) for path in caches]
    for other, journal in applied_states(skip=state.root):
        for entry in (journal or {}).get("entries", []):
            held = [record["path"] for record in entry["sources"] + entry["artifacts"]] + [
                cache["path"] for cache in entry["caches"]]
            for option, path in wanted:
                for their in held:
                    if is_within(path, their) or is_within(their, path):
                        raise OverlayError("E120", "%s %s is already held by the overlay at %s "
                                           "(entry %d, %s); nothing was changed: revert that "
                                           "one first (`%s revert`), or add this change to "
                                           "it with --state %s"
                                           % (option, path, other.root, entry["id"], their,
                                              tool_at(other), shell_quote(other.root)))


CLAIM_SUFFIX = ".overlay-claim"


def claim_path(source: str) -> str:
    """The claim beside a source that an applied overlay holds: every state
    directory and every user on the machine finds the holder from the file
    itself, whichever registry lists it."""
    directory, name = os.path.split(source)
    if len(os.fsencode(name)) + len(CLAIM_SUFFIX) + 1 > 255:  # NAME_MAX: a name of its hash
        name = hashlib.sha256(os.fsencode(name)).hexdigest()[:16]
    return os.path.join(directory, ".%s%s" % (name, CLAIM_SUFFIX))


def is_claim(name: str) -> bool:
    return name.startswith(".") and name.endswith(CLAIM_SUFFIX)


def read_claim(source: str) -> Optional[dict]:
    """The claim on `source`, None when there is none."""
    try:
        with open(claim_path(source), "rb") as handle:
            claim = json.loads(handle.read(CLAIM_LIMIT).decode("utf-8"))
    except FileNotFoundError:
        return None
    except (OSError, ValueError):
        return {}  # unreadable: names no holder, so it holds nothing
    return claim if isinstance(claim, dict) else {}


def claim_holder(source: str, state: State) -> Optional[dict]:
    """The claim on `source` of another state directory that still holds it:
    its journal names the source, or cannot be read (another user's private
    state directory).  A claim whose overlay was reverted is no hold."""
    claim = read_claim(source)
    root = (claim or {}).get("state")
    if not isinstance(root, str) or not os.path.isabs(root) or root == state.root:
        return None
    try:
        journal = State(root).read_journal()
    except OverlayError:
        return claim
    if journal is None:
        return None
    entries = journal.get("entries") if isinstance(journal.get("entries"), list) else []
    return claim if any(isinstance(record, dict) and record.get("path") == source
                        for entry in entries if isinstance(entry, dict)
                        for record in (entry.get("sources") or []) + (entry.get("artifacts") or [])
                        ) else None


def held_by(source: str, claim: dict, option: str = "--source") -> OverlayError:
    user = "%s (uid %s)" % (claim.get("user"), claim.get("uid"))
    return OverlayError("E124", "%s %s is held by the overlay at %s (entry %s) of user %s, "
                        "as %s says; nothing was changed: revert that one first (`overlay_setup.py "
                        "--state %s revert`, as %s)"
                        % (option, source, claim.get("state"), claim.get("entry"), user,
                           claim_path(source), shell_quote(str(claim.get("state"))),
                           claim.get("user")))


def write_claim(state: State, entry_id: int, source: str) -> None:
    """Claim `source` for entry `entry_id` of `state`: made whole under a
    temporary name, then linked into place, which fails where another run
    claimed it first."""
    claim = {"state": state.root, "entry": entry_id, "uid": os.geteuid(), "host": host_name(),
             "user": user_name()}
    path = claim_path(source)
    tmp = temp_beside(path, "claim")
    mutation_point()
    remove_file(tmp)
    # The one fsync of the directory, after the link, makes the claim and the
    # removal of its temporary name durable together.
    put_file(tmp, {"mode": 0o644}, data=(json.dumps(claim, sort_keys=True) + "\n").encode(),
             sync_directory=False)
    try:
        try:
            os.link(tmp, path)
        except FileExistsError:
            holder = claim_holder(source, state)
            if holder is not None:
                raise held_by(source, holder)
            os.replace(tmp, path)  # ours already, or one its overlay left behind
    finally:
        remove_file(tmp, sync_directory=False)
    fsync_dir(os.path.dirname(path))


def drop_claim(state: State, source: str) -> None:
    """Remove this state's claim on `source` (another's stays)."""
    remove_file(temp_beside(claim_path(source), "claim"))
    if (read_claim(source) or {}).get("state") == state.root:
        remove_file(claim_path(source))


def user_name() -> str:
    try:
        return pwd.getpwuid(os.geteuid()).pw_name
    except KeyError:
        return "uid %d" % os.geteuid()


@contextlib.contextmanager
def claims_locked():
    """Held from the claim check until the entry that claims the paths is
    journaled: two state directories checking at the same moment would each
    read the other's journal before it names them, and both apply.  The lock
    is on the folder that holds the registry the check reads, which every
    state directory of this user shares."""
    home = os.path.dirname(registry_dir())
    check_state_home()
    makedirs_durable(home, 0o700)
    fd = os.open(home, os.O_RDONLY | os.O_DIRECTORY)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:  # held while another apply backs up and journals (seconds)
            print("waiting for another overlay to journal what it claims (lock on %s)" % home,
                  file=sys.stderr, flush=True)
            fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def check_state_outside_build(state: State, build: Optional[dict]) -> None:
    """Refused before the state directory is even created: one inside the
    build directory dies with the build's clean step (`git clean -xdf`)."""
    for tree in build_trees(build):  # the working directory, and the one of `make -C DIR`
        if is_within(state.root, tree) or is_within(os.path.realpath(state.root),
                                                    os.path.realpath(tree)):
            raise OverlayError("E121", "the state directory %s lies inside the build directory "
                               "%s, where a clean step of the build (`make clean`, `git clean "
                               "-xdf`) would delete the journal and the backups; nothing was "
                               "changed: pass --state DIR outside it, or leave --state and "
                               "$OVERLAY_STATE unset for the default, %s"
                               % (state.root, tree, default_state_dir(os.getcwd())))


def linked_from_outside(cache: str) -> Optional[Tuple[str, int, int]]:
    """(path, links, links outside) of the first file of `cache` that has hard
    links outside it, else None.  A snapshot gives a file back under a new
    inode, which names outside the cache no longer share; links within the
    cache come back (the snapshot holds them)."""
    found: Dict[Tuple[int, int], list] = {}
    for path, st in walk_tree(cache, []):
        if stat.S_ISREG(st.st_mode) and st.st_nlink > 1:
            found.setdefault((st.st_dev, st.st_ino), [path, st.st_nlink, 0])[2] += 1
    for path, links, inside in sorted(found.values()):
        if inside < links:
            return path, links, links - inside
    return None


def validate_native_plan(state: State, journal: dict, sources: List[str], artifacts: List[str],
                         caches: List[str], build_cwd: Optional[str]) -> None:
    overlaid = {record["path"] for entry in journal["entries"] for record in entry["sources"]}
    state_real = os.path.realpath(state.root)
    for source in sources:
        if source in overlaid:
            raise OverlayError("E103", "source %s is already overlaid; run `%s revert` first"
                               % (source, tool_at(state)))
        if os.path.islink(source):
            raise OverlayError("E104", "source %s is a symlink; pass the file it points to (%s)"
                               % (source, os.path.realpath(source)))
    for path in sources + artifacts:
        if is_within(path, state.root) or is_within(path, state_real):
            raise OverlayError("E106", "%s lies inside the state directory %s; keep the state "
                               "directory outside the install" % (path, state.root))
    for path in sources:  # an artifact in a cache is judged against its set-aside copy
        for cache in caches:
            if is_within(path, cache):
                raise OverlayError("E106", "%s lies inside --invalidate-cache %s, which is set "
                                   "aside whole; drop one of them" % (path, cache))
    for artifact in artifacts:
        if artifact in sources:
            raise OverlayError("E106", "%s is both the source and an --artifact; drop the "
                               "--artifact" % artifact)
    for cache in caches:
        if is_within(state.root, cache) or is_within(state_real, cache) or is_within(cache, state.root):
            raise OverlayError("E106", "--invalidate-cache %s overlaps the state directory %s; "
                               "keep them apart" % (cache, state.root))
        if os.path.lexists(cache) and (os.path.islink(cache) or not os.path.isdir(cache)):
            raise OverlayError("E104", "--invalidate-cache %s is not a directory; pass the cache "
                               "directory itself" % cache)
        if build_cwd and is_within(build_cwd, cache):
            raise OverlayError("E106", "--build-cwd %s lies inside --invalidate-cache %s; pick "
                               "another build directory" % (build_cwd, cache))
    if len(set(caches)) != len(caches) or len(set(artifacts)) != len(artifacts):
        raise UsageError("E106", "an --artifact or --invalidate-cache is given twice; give each once")
    for path in sources + artifacts + caches + ([build_cwd] if build_cwd else []):
        link = symlink_on_the_way(path + "/" if path == build_cwd else path)
        if link:  # revert reaches every path without following a symlink
            raise OverlayError("E104", "%s lies under %s, which is a symlink; pass the real path "
                               "%s" % (path, link, os.path.realpath(path)))
    for cache in caches:
        if mount_of(cache) != mount_of(os.path.dirname(cache)):  # also a bind mount of one fs
            raise OverlayError("E106", "--invalidate-cache %s is a mount point, which cannot be "
                               "set aside; pass a directory inside it, or unmount it"
                               % cache)
    state_mount = mount_of(state.root)
    for source in sources + [path for path in artifacts
                             if not any(is_within(path, cache) for cache in caches)]:
        st = os.lstat(source) if os.path.lexists(source) else None
        if st and st.st_nlink > 1 and mount_of(os.path.dirname(source)) != state_mount:
            raise OverlayError("E106", "%s %s has %d hard links, and the state directory %s "
                               "is on another filesystem or mount, so revert could not give the "
                               "links their file back; pass a --state on the same mount"
                               % ("source" if source in sources else "--artifact", source,
                                  st.st_nlink, state.root))
    for cache in caches:
        linked = linked_from_outside(cache) if os.path.isdir(cache) and \
            mount_of(cache) != state_mount else None  # a cache to snapshot: not renamed
        if linked:
            raise OverlayError("E122", "--invalidate-cache %s holds %s, which has %d hard links, "
                               "%d of them outside the cache: restored from a snapshot it "
                               "would come back as a separate file; nothing was changed: pass "
                               "a --state on the cache's mount (the cache is then renamed aside "
                               "whole), or give the file a copy of its own" % ((cache,) + linked))
    if build_cwd is not None and not os.path.isdir(build_cwd):
        raise UsageError("E107", "--build-cwd %s is not a directory; pass the directory the "
                           "build command runs in" % build_cwd)


def track_parents(entry: dict, paths: List[str]) -> None:
    """Every path a revert acts on lies under one of the entry's roots
    (checked on load); their parent directories get their mtimes back too
    (temp files and renames touch them)."""
    entry["roots"] = sorted(set(entry["roots"]) | {os.path.dirname(path) for path in paths})
    for path in paths:
        parent = os.path.dirname(path)
        if os.path.isdir(parent) and parent not in entry["dirs"]:
            entry["dirs"][parent] = os.stat(parent).st_mtime_ns


class NativePlan:
    """What add-native or apply will do to the install, worked out before
    anything changes: the sources to patch (`changes`: each with its patched
    content, None to delete it; `modes`: a new mode for some), the artifacts
    and build products to back up, the caches to set aside, the build to run.
    --dry-run checks and prints it; the real run journals and carries out
    this same plan."""

    def __init__(self, state: State, args: argparse.Namespace,
                 changes: List[Tuple[str, Optional[bytes]]], artifacts: List[str],
                 caches: List[str], build: Optional[dict], modes: Optional[Dict[str, int]] = None,
                 modules: Optional[List[Tuple[str, str]]] = None):
        self.state = state
        self.changes = changes
        self.sources = [path for path, _ in changes]
        self.modes = modes or {}
        self.modules = modules or []  # (name, origin) of the Python part
        self.artifacts, self.caches = artifacts, caches
        self.build = build if changes else None  # a patch of .py files alone builds nothing
        self.no_build = args.no_build
        self.protect, self.no_protect = args.protect, args.no_protect
        # make -n -W evaluates the Makefile's $(shell ...) (only recipes are
        # not run): make is asked only once the entry is journaled, and never
        # by --dry-run.
        self.asks_make = bool(changes) and not self.no_protect and asks_make(self.build)
        # Worked out now, so that the budget is refused before anything changes.
        self.protected = self.build_products(ask_make=False) if changes else []

    def build_products(self, ask_make: bool = True) -> List[Tuple[str, str]]:
        """[(path, why)] of the existing build products to back up."""
        return protected_paths(self.state, self.sources, self.artifacts, self.caches, self.build,
                               self.protect, self.no_protect, ask_make)

    def products(self) -> List[Tuple[str, str]]:
        """The build products to back up, asked for once the entry is
        journaled (what make's plan writes is then the entry's to undo)."""
        return self.build_products() if self.asks_make else self.protected

    def check_claims(self) -> None:
        check_claims(self.state, self.sources, self.artifacts, self.caches)
        for option, paths in (("--source", self.sources), ("--artifact", self.artifacts)):
            for path in paths:
                holder = claim_holder(path, self.state)
                if holder is not None:
                    raise held_by(path, holder, option)

    def check(self, journal: dict) -> None:
        """Refuse what the journal or the paths rule out, before anything changes."""
        validate_native_plan(self.state, journal, self.sources, self.artifacts, self.caches,
                             self.build and self.build["cwd"])

    def dry_run(self) -> int:
        """Check the plan as the real run would and print it; change nothing."""
        state = self.state
        self.check_claims()
        self.check(state.load() if state.exists() else empty_journal())
        for tree in build_trees(self.build):
            if scan_tree(tree, [state.root])[1]:
                raise scan_limit_reached(tree)
        print("plan (--dry-run: nothing was changed):")
        for path, patched in self.changes:
            print("  %-10s %s" % ("delete" if patched is None else
                                  "patch" if os.path.lexists(path) else "create", path))
        for name, origin in self.modules:
            print("  %-10s module %s from %s (Python overlay)" % ("overlay", name, origin))
        for path in self.sources:
            if os.path.lexists(path):
                print("  %-10s %s (source)" % ("back up", path))
        for path in self.artifacts:
            cache = next((cache for cache in self.caches if is_within(path, cache)), None)
            if cache is not None:
                print("  %-10s %s (artifact in the cache %s: compared with its set-aside copy)"
                      % ("compare", path, cache))
                continue
            print("  %-10s %s (artifact%s)" % ("back up", path,
                                               "" if os.path.lexists(path) else ", absent now"))
        kept = collections.Counter(  # a distribution's files, counted: torch has thousands
            why for _, why in self.protected if why.startswith(DISTRIBUTION_WHY % ""))
        for path, why in self.protected:
            if why not in kept:
                print("  %-10s %s (build product, %s)" % ("back up", path, why))
        for dist_info in (self.build or {}).get("distributions") or []:
            print("  %-10s the %d other files of the installed distribution %s (its RECORD and "
                  "dist-info), %s" % (
                      "keep", kept[DISTRIBUTION_WHY % os.path.basename(dist_info)],
                      dist_info, "each by a hard link: pip writes files anew"
                      if links_distribution(state, self.build, dist_info) else "each copied"))
        if self.asks_make:
            print("  %-10s the build products make -n -W names (not asked by --dry-run: make "
                  "evaluates the Makefile's $(shell ...) to answer; a real run asks once its "
                  "journal is written)" % "back up")
        if self.build is not None:
            print("  %-10s the small files of %s that are no build product (up to %d KiB each, "
                  "%d files and %d MiB in all; dropped after the build for each file it left "
                  "alone)" % ("back up", ", ".join(build_trees(self.build)),
                              ORIGINAL_FILE_LIMIT >> 10, ORIGINAL_COUNT, ORIGINAL_BUDGET >> 20))
        for path in self.caches:
            print("  %-10s %s (cache%s)" % ("set aside", path,
                                            "" if os.path.lexists(path) else ", absent now"))
        if self.build is not None:
            print("  %-10s %s (in %s)" % ("build", self.build["cmd"], self.build["cwd"]))
        elif self.no_build and self.changes:
            print("  %-10s none (--no-build: a later build, such as a JIT at import, rebuilds; "
                  "then `%s verify-native`)" % ("build", tool_at(state)))
        elif self.changes:
            candidates = build_candidates(self.sources)
            print("  %-10s none given; found near %s (suggestions, never run by themselves):"
                  % ("build", self.sources[0] if len(self.sources) == 1 else "the sources"))
            for option, why in candidates:
                print("    %s  (%s)" % (option, why))
            if not candidates:
                print("    nothing: pass --build-cmd CMD (the install's own build) or --no-build")
        return 0

    def run(self, journal: dict, command: str, python_update=None,
            in_trial: bool = False) -> Optional["NativeEntry"]:
        """Carry the plan out (with the Python part), rolling back if anything
        fails before the build, and on Ctrl-C at any point (a trial reverts
        by itself); a second Ctrl-C stops that and leaves it to `revert`."""
        entry_id, modules_before = journal["next_id"], set(journal["python"]["modules"])
        try:
            return self.carry_out(journal, command, python_update, in_trial)
        except KeyboardInterrupt:
            if in_trial:
                raise
            here = tool_at(self.state)
            print("overlay_setup: interrupted; reverting what this run applied (Ctrl-C again "
                  "leaves it to `%s revert`)" % here, file=sys.stderr, flush=True)
            try:
                self.undo(entry_id, modules_before)
            except KeyboardInterrupt:
                print("overlay_setup: interrupted again: that revert stopped halfway",
                      file=sys.stderr, flush=True)
                raise
            except (OSError, OverlayError) as exc:
                raise OverlayError("E601", "interrupted, and taking back what this run applied "
                                   "failed (%s); run `%s revert` once the cause is fixed"
                                   % (getattr(exc, "strerror", None) or exc, here))
            raise RolledBack()

    def carry_out(self, journal: dict, command: str, python_update,
                  in_trial: bool) -> Optional["NativeEntry"]:
        state = self.state
        entry = None
        entry_id = journal["next_id"]
        modules_before = set(journal["python"]["modules"])
        try:
            if self.changes:
                with claims_locked():
                    self.check_claims()
                    entry = NativeEntry.apply(state, journal, self, command)
                records = [r for r in entry.record["protected"] if r["role"] != ORIGINAL]
                installed = collections.Counter(  # the files of each distribution, counted
                    r["why"] for r in records if r["why"].startswith(DISTRIBUTION_WHY % ""))
                products = ["the %d files %s" % (count, why) for why, count in
                            sorted(installed.items())] + [
                    "%s (%s)" % (shown(r["path"]), r["why"]) for r in records
                    if r["why"] not in installed]
                if products:  # a trial reverts before the user could run `status`
                    print("backed up %d build product(s) the build may rewrite: %s"
                          % (len(records), shown_list(products, "" if in_trial
                                                      else " (`status` lists them)")))
            if python_update is not None:
                python_update()
        except OSError as exc:
            self.rollback(entry_id, modules_before, exc)
        print("state: %s" % state.root, flush=True)
        if entry is not None and self.build is not None:
            entry.build()
        return entry

    def undo(self, entry_id: int, modules_before: set) -> None:
        """Undo what this command did (the journal on disk says how far it got)."""
        state = self.state
        journal = state.load()
        modules = journal["python"]["modules"]
        if set(modules) - modules_before:
            for name in set(modules) - modules_before:
                del modules[name]
            write_python_overlay(state, journal)
            state.save(journal)
        for entry in list(journal["entries"]):
            if entry["id"] == entry_id:
                NativeEntry(state, journal, entry).revert()
        remove_orphaned_backups(state, journal)

    def rollback(self, entry_id: int, modules_before: set, exc: OSError) -> None:
        state = self.state
        try:
            self.undo(entry_id, modules_before)
        except (OSError, OverlayError) as second:
            raise OverlayError("E601", "%s (%s), and rolling back failed too (%s); "
                               "run `%s revert` once the cause is fixed"
                               % (io_failure(exc), exc.strerror,
                                  getattr(second, "strerror", second), tool_at(state)))
        raise OverlayError("E601", "%s (%s); nothing stays applied: fix the cause and run the "
                           "command again" % (io_failure(exc), exc.strerror))


def kept_product(state: State, path: str, why: str, backup: str, replaced: bool) -> dict:
    """The record of a build product kept as `backup` before the build: a
    file that the build replaces (writes anew and renames over it, or
    unlinks first) by a hard link, in constant time and space, its hash not
    read; else, and on another filesystem, by a copy."""
    record = record_file(path, "build product")
    record["why"], record["backup"], record["sha256"] = why, backup, None
    linked = False
    if replaced:
        mutation_point()
        try:
            os.link(path, state.state_path(backup), follow_symlinks=False)
            linked = True
        except OSError as exc:
            if exc.errno != errno.EXDEV:
                raise
    if not linked:
        record["sha256"] = durable_copy(path, state.state_path(backup))
    record["identity"] = file_identity(path)
    return record


def scan_limit_reached(tree: str) -> OverlayError:
    """A scan that stops at its limit is no record of what was there: the
    files beyond it would count as made by the build, and revert would delete
    them.  Refused before anything changes."""
    return OverlayError("E110", "the build directory %s holds more than %d entries, more than "
                        "the scan that tells the build's new files from yours records; nothing "
                        "was changed: pass --build-cwd (or make -C) at the folder the build "
                        "writes in, or --no-build and run the build yourself (revert then "
                        "leaves what it makes)" % (tree, SCAN_LIMIT))


def write_prebuild_scan(state: State, entry: dict, key: str = "scan") -> Dict[str, list]:
    """What the build directory holds before a build, to find its untracked
    products afterwards (also after a crash during the build): before the
    first build ("scan", also what revert puts back), before the latest
    ("build_scan", what that build is compared with).  Returns it."""
    before, truncated = scan_build(state, entry)
    if truncated:
        raise scan_limit_reached(build_trees(entry["build"])[0])
    for link, info in before.items():
        if info[0] == "l":
            try:
                info.append(os.readlink(link))
            except OSError:
                pass
    entry[key] = "backups/%d/%s.json" % (entry["id"], "prebuild-scan" if key == "scan"
                                         else "build-scan-%d" % entry["builds"])
    durable_write(state.state_path(entry[key]), json.dumps(before).encode())
    return before


def back_up_originals(state: State, journal: dict, entry: dict, scanned: Dict[str, list]) -> None:
    """Copy the small pre-existing files of the build directory (`scanned`)
    into the entry's backups, before its build, so that revert gives back a
    version file the build rewrites or a file it deletes.  Nearest the build
    directory first, within ORIGINAL_FILE_LIMIT, ORIGINAL_BUDGET and
    ORIGINAL_COUNT; what lies beyond is not copied, and revert names it if
    the build rewrote or deleted it (E506).  Not copied either: build
    products (build_product: --protect and the plan back them up), a file
    with other hard links (a copy would come back as a file of its own), and
    what an entry of the state records already: an update's build must not
    take the rewrite of an earlier build for the original."""
    recorded = {record["path"] for one in journal["entries"] + [entry]
                for record in entry_files(one) + (one.get("untracked") or [])
                + (one.get("earlier_untracked") or [])}
    total = count = 0
    for path in sorted((path for path, info in scanned.items()
                        if info[0] == "f" and info[1] <= ORIGINAL_FILE_LIMIT
                        and path not in recorded), key=lambda path: (path.count(os.sep), path)):
        if count == ORIGINAL_COUNT:
            break
        try:
            st = os.lstat(path)
        except OSError:
            continue
        if not stat.S_ISREG(st.st_mode) or st.st_nlink > 1 or total + st.st_size > \
                ORIGINAL_BUDGET or build_product(path, build_trees(entry["build"])):
            continue
        record = record_file(path, ORIGINAL)
        record["backup"] = "backups/%d/o%d-%d" % (entry["id"], entry.get("builds", 1), count)
        record["sha256"] = durable_copy(path, state.state_path(record["backup"]))
        record["identity"] = file_identity(path)
        entry["protected"].append(record)
        total += st.st_size
        count += 1
    if count:
        fsync_dir(state.state_path("backups/%d" % entry["id"]))


def write_jit_scan(state: State, entry: dict, directories: List[str]) -> None:
    """What each JIT build directory holds before the JIT runs in it, to find
    what a JIT killed mid-build leaves there (ninja's .ninja_lock, torch's
    lock file, a partial object) whoever ran it."""
    entry["jit"] = None
    found: Dict[str, list] = {}
    for directory in directories:
        part, truncated = scan_tree(directory, scan_exclusions(state, entry))
        if truncated:
            return  # an incomplete scan would make old files look new
        found.update(part)
    if not directories:
        return
    entry["jit"] = {"directories": directories, "scan": "backups/%d/jit-scan.json" % entry["id"]}
    durable_write(state.state_path(entry["jit"]["scan"]), json.dumps(found).encode())


# ---------------------------------------------------------------- running a build


def stop_process_group(pgid: int, process: Optional[subprocess.Popen] = None) -> None:
    """SIGTERM the build, then SIGKILL what is still there after 2 s.  The
    build is its process group and every process of its session: ninja runs
    each job in a process group of its own, which outlives a ninja that is
    killed.  `process`, when given, is the leader (our child), reaped here."""
    for signum in (signal.SIGTERM, signal.SIGKILL):
        for member in [None] + session_members(pgid):
            try:
                if member is None:
                    os.killpg(pgid, signum)
                else:
                    os.kill(member, signum)
            except (ProcessLookupError, PermissionError):
                pass
        deadline = time.monotonic() + 2
        while time.monotonic() < deadline:
            if process is not None:
                process.poll()
            if not group_alive(pgid):
                if process is not None:
                    process.wait()  # dead or a zombie by now: reaped at once
                return
            time.sleep(0.05)


def live_process_stats() -> Optional[List[Tuple[int, List[str]]]]:
    """(pid, the fields of /proc/PID/stat after the command name) of every
    process other than a zombie; None where there is no /proc."""
    try:
        names = os.listdir("/proc")
    except OSError:
        return None
    if not os.path.exists("/proc/self/stat"):
        return None
    found = []
    for name in names:
        if not name.isdigit():
            continue
        try:
            with open("/proc/%s/stat" % name, "rb") as handle:
                text = handle.read().decode("ascii", "replace")
        except OSError:
            continue
        fields = text[text.rfind(")") + 2:].split()
        if len(fields) > 3 and fields[0] != "Z":
            found.append((int(name), fields))
    return found


def session_members(sid: int) -> List[int]:
    """The processes of session `sid` other than zombies, from /proc ([] without it)."""
    return [pid for pid, fields in live_process_stats() or () if fields[3] == str(sid)]


def group_alive(pgid: int) -> bool:
    """Whether a process other than a zombie is in the process group or in
    the session it leads (from /proc where there is one: a zombie nobody
    reaped still counts for kill).  /proc is read twice before the answer is
    no: one reading misses a process forked while it ran by a parent that
    exited before its turn came, such as the assembler a compiler driver
    starts as it is stopped, which would write its object after the revert."""
    for _ in range(2):
        processes = live_process_stats()
        if processes is None:
            try:
                os.killpg(pgid, 0)
            except (ProcessLookupError, PermissionError):
                return False
            return True
        if any(str(pgid) in (fields[2], fields[3]) for _, fields in processes):
            return True
    return False


# The build's shell waits for one line on its stdin (a pipe from this process)
# before it runs the command: written once the build's pid is journaled, never
# if this process dies first (the pipe then reads end-of-file).  `set --` inside
# the eval leaves the command no positional parameters, as `sh -c CMD` would.
BUILD_GATE = 'read -r overlay_go || exit 125; unset overlay_go; exec </dev/null; eval "set --\n$1"'


def stream_build(command: str, cwd: str, timeout: Optional[float],
                 started: Callable[[int], None]) -> Tuple[Optional[int], float]:
    """Run the caller's build command, streaming its output with the elapsed time.
    Returns (exit status or None on timeout, seconds).  `started` gets the pid
    of the build (the leader of its own process group) and makes it durable
    before the command may run.  If this process is interrupted (Ctrl-C,
    SIGTERM, SIGHUP), the build is stopped with it."""
    def stop(signum: int, frame: object) -> None:
        raise Stopped(signum)

    previous = {signum: signal.signal(signum, stop) for signum in (signal.SIGTERM, signal.SIGHUP)}
    gate_read, gate_write = os.pipe()
    try:
        start = time.monotonic()
        try:
            process = subprocess.Popen(["/bin/sh", "-c", BUILD_GATE, "sh", command], cwd=cwd,
                                       stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                       stdin=gate_read, start_new_session=True)
        finally:
            os.close(gate_read)
        try:
            started(process.pid)
            os.write(gate_write, b"go\n")
            os.close(gate_write)
            gate_write = -1
            status, seconds = follow_build(process, start, timeout)
            if status is not None:
                wait_for_group(process.pid)
                seconds = time.monotonic() - start
            return status, seconds
        except BaseException:
            stop_process_group(process.pid, process)
            process.stdout.close()
            raise
    finally:
        if gate_write >= 0:
            os.close(gate_write)
        for signum, handler in previous.items():
            signal.signal(signum, handler)


def follow_build(process: subprocess.Popen, start: float,
                 timeout: Optional[float]) -> Tuple[Optional[int], float]:
    """Show the build's output as it comes until it ends, the timeout passes,
    or OUTPUT_GRACE after the build's own process exited once its group is
    gone, LINGER_LIMIT while it lives (a helper it left running, such as a
    compile server, may hold the output open for good)."""
    selector = selectors.DefaultSelector()
    selector.register(process.stdout, selectors.EVENT_READ)
    pending = b""
    timed_out = False
    exited = None
    last_output = time.monotonic()
    while True:
        now = time.monotonic()
        if timeout is not None and now - start >= timeout:
            timed_out = True
            break
        if exited is None and process.poll() is not None:
            exited = now
        if exited is not None and now - exited >= OUTPUT_GRACE and (
                now - exited >= LINGER_LIMIT or not group_alive(process.pid)):
            # while the build's group lives, its output is its own: a job
            # left in the background would die of a closed pipe (SIGPIPE)
            print("warning: the build exited, but a process it started still holds its output "
                  "open; its output is no longer shown", file=sys.stderr)
            break
        wait = OUTPUT_POLL if timeout is None else min(OUTPUT_POLL, timeout - (now - start))
        if not selector.select(wait):
            if pending.rstrip(b"\r") and now - last_output >= OUTPUT_QUIET:
                show_output_line(pending.rstrip(b"\r"), start)  # a line still being written
                pending = b""
            continue
        block = os.read(process.stdout.fileno(), 65536)
        if not block:
            break
        last_output = now
        pending = show_output(pending + block, start)
    if pending.rstrip(b"\r"):
        show_output_line(pending.rstrip(b"\r"), start)
    selector.close()
    if timed_out:
        stop_process_group(process.pid, process)
        process.wait()
        process.stdout.close()
        return None, time.monotonic() - start
    process.stdout.close()
    return process.wait(), time.monotonic() - start


def group_members(pgid: int) -> List[int]:
    """The live processes of process group or session `pgid` ([] without /proc)."""
    return sorted(pid for pid, fields in live_process_stats() or ()
                  if str(pgid) in (fields[2], fields[3]))


def wait_for_group(pgid: int) -> None:
    """A build is over when its whole process group and session are gone,
    not when its shell exits: a job it left in the background (`make && {
    ...; } &`) would write into the tree after the scan, or after revert.
    What still runs LINGER_LIMIT seconds later is stopped and named."""
    deadline = time.monotonic() + LINGER_LIMIT
    while group_alive(pgid):
        if time.monotonic() >= deadline:
            members = group_members(pgid)
            stop_process_group(pgid)
            print("warning: the build's shell exited, but %s %s of its process group still ran "
                  "%gs later; %s stopped, and the build taken as over"
                  % ("process" if len(members) == 1 else "processes",
                     ", ".join("%d (%s)" % (pid, process_name(pid)) for pid in members),
                     LINGER_LIMIT, "it was" if len(members) == 1 else "they were"),
                  file=sys.stderr)
            return
        time.sleep(0.05)


def show_output(buffer: bytes, start: float) -> bytes:
    """Print the lines of `buffer` that are complete (ended by \\n, \\r\\n, or a
    lone \\r as progress bars write) and return the rest, which is printed
    too once it is OUTPUT_LINE_LIMIT long: the rest stays that short, so the
    output costs time and memory in proportion to its size."""
    held = b""
    if buffer.endswith(b"\r"):  # perhaps the first half of \r\n
        buffer, held = buffer[:-1], b"\r"
    *lines, rest = OUTPUT_LINE_END_RE.split(buffer)
    for line in lines:
        show_output_line(line, start)
    if len(rest) >= OUTPUT_LINE_LIMIT:
        show_output_line(rest, start)
        rest = b""
    return rest + held


def show_output_line(line: bytes, start: float) -> None:
    print("[%7.1fs] %s" % (time.monotonic() - start, line.decode("utf-8", "replace")), flush=True)


def state_vanished(state: State) -> bool:
    return not (state.exists() and os.path.isdir(state.backups))


def build_deleted_state(state: State, entry: dict) -> OverlayError:
    return OverlayError("E406", "the build deleted the state directory %s (a clean step?): %s "
                        "stay%s patched and the backups are lost; restore from version control "
                        "or a reinstall, then delete %s" % (
                            state.root, ", ".join(r["path"] for r in entry["sources"]),
                            "s" if len(entry["sources"]) == 1 else "",
                            state.root if in_state_home(state.root)
                            else registry_record(state.root)))


def headers_build_ext_skips(command: str, entry: dict) -> bool:
    """Whether `command` is a setuptools build_ext without --force and every
    patched source a header, which it does not look at."""
    return bool(re.search(r"\bbuild_ext\b", command)) and not re.search(
        r"(^|\s)(--force|-f)(\s|$)", command) and all(
        os.path.splitext(record["path"])[1] in (".h", ".hpp", ".cuh")
        for record in entry["sources"])


# ---------------------------------------------------------------- a native entry's life


def journal_field(key: str) -> property:
    """An entry's journal field as an attribute of NativeEntry."""
    def read(entry: "NativeEntry") -> object:
        return entry.record.get(key)

    def write(entry: "NativeEntry", value: object) -> None:
        entry.record[key] = value
    return property(read, write)


class NativeEntry:
    """One native entry of the journal (`record`, a JSON object in it) and
    the steps of its life, each journaled durably before the install
    changes: apply (back up, journal, set the caches aside, swap the
    sources in), build, update (swap a new patch in and build again),
    revert.  Its state in the journal says how far it got."""

    APPLYING = "applying"  # journaled, being applied or built: a crash here is rolled back
    APPLIED = "applied"  # swapped in without a build (--no-build)
    BUILT = "built"  # its build exited 0 and changed the artifacts
    BUILD_FAILED = "build-failed"  # its build failed or timed out; the patch stays applied
    BUILT_NOTHING = "build-changed-nothing"  # its build exited 0 but changed no artifact

    # The fields of an entry's journal record, read and written through
    # these names only (JOURNAL_FIELDS checks their types on load).
    id = journal_field("id")
    phase = journal_field("state")
    sources = journal_field("sources")
    artifacts = journal_field("artifacts")
    caches = journal_field("caches")
    build_record = journal_field("build")  # the build command and its run; None: --no-build
    untracked = journal_field("untracked")  # None: its last build did not complete
    protected = journal_field("protected")
    dirs = journal_field("dirs")
    jit = journal_field("jit")
    folders_turned = journal_field("folders_turned")  # {folder: the link its build left}

    def __init__(self, state: State, journal: dict, record: dict):
        self.state, self.journal, self.record = state, journal, record
        # Upgraded once, here: a journal of version 1.0 lacks these.
        if record.get("protected") is None:
            record["protected"] = []
        record.setdefault("dirs", {})

    def enter(self, name: str) -> None:
        """Move to the state `name`, journaled before what it names happens."""
        self.record["state"] = name
        self.state.save(self.journal)

    @classmethod
    def apply(cls, state: State, journal: dict, plan: NativePlan, command: str) -> "NativeEntry":
        """Make the backups and the journal entry durable, then set the caches
        aside and swap the sources.  A crash before the entry is journaled
        leaves only unreferenced backups; the install is untouched until then.
        The build products to back up besides are asked of the plan once the
        entry is journaled (NativePlan.products)."""
        changes, artifacts, caches, build = plan.changes, plan.artifacts, plan.caches, plan.build
        entry_id = journal["next_id"]
        directory = "backups/%d" % entry_id
        entry = {"id": entry_id, "command": command, "state": cls.APPLYING,
                 "sources": [], "artifacts": [], "caches": [], "build": build,
                 "scan": None, "untracked": None, "protected": []}
        for number, (source, patched) in enumerate(changes):
            record = record_file(source, "source")
            record["folder"] = folder_identity(source)  # an upgrade replaces it
            record["patched_sha256"] = hashlib.sha256(patched).hexdigest() \
                if patched is not None else None
            if record["present"]:
                record["backup"] = "%s/s%d" % (directory, number)
            entry["sources"].append(record)
        for number, artifact in enumerate(artifacts):
            record = record_file(artifact, "artifact")
            cache = next((cache for cache in caches if is_within(artifact, cache)), None)
            if cache is not None:
                # Set aside with its cache and put back with it (a JIT's build
                # directory): the rebuilt one is compared with the copy there.
                record = {"path": artifact, "role": "artifact", "present": False, "backup": None,
                          "in_cache": cache}
            elif record["present"]:
                record["backup"] = "%s/a%d" % (directory, number)
            entry["artifacts"].append(record)
        backup_mount = mount_of(state.root)
        for number, cache in enumerate(caches):
            present = os.path.isdir(cache)
            same_fs = present and mount_of(cache) == backup_mount  # else a rename fails (EXDEV)
            # What the cache holds is read for a tar snapshot only: a revert killed after
            # the snapshot's extraction finds the cache back by it, whereas a renamed
            # cache that is back has left no backup (rebuilt_since_apply).
            entry["caches"].append({"path": cache, "present": present,
                                    "digest": None if same_fs else tree_digest(cache),
                                    "mtime_ns": os.stat(cache).st_mtime_ns if present else None,
                                    "method": "rename" if same_fs or not present else "tar",
                                    "backup": "%s/c%d%s" % (
                                        directory, number,
                                        "" if same_fs or not present else ".tar")})
        entry["roots"] = sorted(set(build_trees(build)) | ({build["cwd"]} if build else set()))
        entry["dirs"] = {}
        track_parents(entry, plan.sources + artifacts + caches)
        # pip stashes a distribution's folders in its site folder and makes them anew there
        sites = [os.path.dirname(dist_info)
                 for dist_info in (build or {}).get("distributions") or []]
        for tree in build_trees(build) + sites:
            if os.path.isdir(tree):
                entry["dirs"].setdefault(tree, os.stat(tree).st_mtime_ns)

        backup_dir = os.path.join(state.root, directory)
        remove_path(backup_dir)
        makedirs_durable(backup_dir)
        scanned: Dict[str, list] = {}
        if build is not None:
            try:
                scanned = write_prebuild_scan(state, entry)
            except OverlayError:
                remove_path(backup_dir)
                raise
        for record in entry_files(entry):
            record["sha256"] = file_sha256(record["path"]) if record.get("in_cache") else None
            if record["present"] and record["links"] > 1 and record["role"] == "source":
                # The patched file replaces the name; the original inode, shared
                # with its other names, becomes the backup and comes back.
                mutation_point()
                os.link(record["path"], state.state_path(record["backup"]), follow_symlinks=False)
                record["sha256"] = file_sha256(record["path"])
                record["identity"] = file_identity(record["path"])
            elif record["present"]:
                record["sha256"] = durable_copy(record["path"], state.state_path(record["backup"]))
                if record["links"] > 1:  # its inode too, which its other names share
                    record["inode_backup"] = record["backup"] + "-inode"
                    mutation_point()
                    os.link(record["path"], state.state_path(record["inode_backup"]),
                            follow_symlinks=False)
                record["identity"] = file_identity(record["path"])
        # The files of the artifacts' distributions are known to the plan
        # already: kept before the pre-existing files, which would copy them.
        replaced = replaces_files(build)
        for number, (path, why) in enumerate(
                (path, why) for path, why in plan.protected
                if why.startswith(DISTRIBUTION_WHY % "")):
            entry["protected"].append(kept_product(state, path, why, "%s/d%d" % (directory, number),
                                                   replaced))
        # Before make is asked for its plan: its $(shell ...) may write one of them.
        back_up_originals(state, journal, entry, scanned)
        for cache in entry["caches"]:
            if cache["present"] and cache["method"] == "tar":
                snapshot_cache(cache["path"], state.state_path(cache["backup"]))
        write_jit_scan(state, entry, jit_directories(artifacts, build))
        fsync_dir(backup_dir)
        journal["next_id"] = entry_id + 1
        journal["entries"].append(entry)
        state.save(journal)
        try:
            products = plan.products()
        except OverlayError:  # over the budget: undo what asking make did, and the entry
            cls(state, journal, entry).revert()
            raise
        if products:
            track_parents(entry, [path for path, _ in products])
            copied = {record["path"]: record for record in entry["protected"]}
            for number, (path, why) in enumerate(products):
                if path in copied:  # a small file the plan names too: a build product, kept
                    copied[path].update(role="build product", why=why)
                    continue
                entry["protected"].append(kept_product(state, path, why,
                                                       "%s/p%d" % (directory, number), False))
            fsync_dir(backup_dir)
            state.save(journal)

        try:
            for path in cls(state, journal, entry).claimed():
                write_claim(state, entry_id, path)
        except OverlayError:  # claimed by another run since the check
            cls(state, journal, entry).revert()
            raise
        for cache in entry["caches"]:
            if not cache["present"]:
                continue
            if cache["method"] == "rename":
                durable_rename(cache["path"], state.state_path(cache["backup"]))
            else:
                remove_path(cache["path"])
        for (source, patched), record in zip(changes, entry["sources"]):
            if patched is None:
                remove_file(source)
            else:
                put_file(source, {"mode": plan.modes.get(source, record.get("mode", 0o644))},
                         data=patched)
        applied = cls(state, journal, entry)
        if build is None:
            applied.enter(cls.APPLIED)
        return applied


    def build(self) -> int:
        """Build, then record its status, the artifacts' hashes and what the
        build made; the entry is then BUILT, BUILD_FAILED or BUILT_NOTHING."""
        state, journal, entry = self.state, self.journal, self.record
        build = entry["build"]
        fresh = [record for record in self.protected if "seen" not in record]
        ours = still_ours(journal) + fresh
        state.reserve_space(journal)
        mutation_point()
        print("building in %s: %s" % (build["cwd"], build["cmd"]), flush=True)

        def started(pid: int) -> None:  # so that a revert after a crash can stop it
            build["process"] = dict(process_record(pid), since=time.strftime(
                "%Y-%m-%dT%H:%M:%SZ", time.gmtime()))
            state.save(journal)

        try:
            status, seconds = stream_build(build["cmd"], build["cwd"], build.get("timeout"),
                                           started)
        except OSError:
            if state_vanished(state):  # while the build started
                raise build_deleted_state(state, entry)
            raise
        finally:
            with contextlib.suppress(OSError):
                state.release_space()
        if state_vanished(state):
            raise build_deleted_state(state, entry)
        build.pop("process", None)
        build["rc"], build["seconds"] = status, round(seconds, 3)
        for record in entry["artifacts"]:
            identity = content_identity(record["path"])
            unchanged = record["present"] and os.path.isfile(record["path"]) and \
                file_identity(record["path"]) == record["identity"]
            record["built_sha256"] = record["sha256"] if unchanged else \
                content_sha256(record["path"])
            # settle_after_build keeps this hash rather than read the same bytes again
            record["after_build_identity"], record["after_build_sha256"] = \
                identity, record["built_sha256"]
        settle_after_build(journal)
        entry["untracked"] = untracked_products(state, entry)
        entry.pop("earlier_untracked", None)
        # The copies of pre-existing files this build left alone are dropped
        # (removed once the journal no longer names them); what it rewrote or
        # deleted keeps its copy of the original.
        untouched = {id(record) for record in fresh if record["role"] == ORIGINAL
                     and seen(record["path"]) == record["identity"]}
        dropped = [record["backup"] for record in fresh if id(record) in untouched]
        entry["protected"] = [record for record in entry["protected"]
                              if id(record) not in untouched]
        ours = [record for record in ours if id(record) not in untouched]
        # What the build left, to be restored or removed at revert only while it
        # still is exactly that; what earlier builds of the entry left keeps its
        # record (a file edited between two builds is no longer theirs).
        for record in ours + [product for product in entry["untracked"]
                              if product["kind"] != "d" and "seen" not in product]:
            record["seen"] = seen(record["path"])
            if record.get("role") == ORIGINAL:  # small: its content proves it too
                record["built_sha256"] = file_sha256(record["path"])
        entry["links_seen"] = changed_links(state, entry)
        entry["folders_turned"] = {path: seen(path) for path in self.folders_turned_links()}
        for record in entry["sources"]:  # as the build left them (a source it removed: None)
            record["folder"] = folder_identity(record["path"]) \
                if os.path.lexists(record["path"]) else None
        noop = status == 0 and entry["artifacts"] and all(
            record["built_sha256"] == record["sha256"] for record in entry["artifacts"])
        self.enter(self.BUILT_NOTHING if noop else self.BUILT if status == 0 else self.BUILD_FAILED)
        for backup in dropped:
            os.unlink(state.state_path(backup))
        if dropped:
            fsync_dir(state.state_path("backups/%d" % entry["id"]))
        originals = [record["path"] for record in fresh
                     if record["role"] == ORIGINAL and id(record) not in untouched]
        if originals:
            print("the build rewrote or deleted %s; revert puts back the copies taken before it"
                  % shown_list(originals))
        created = [p["path"] for p in entry["untracked"] if p["created"] and p["kind"] != "d"]
        if created:
            print("warning: the build created files that no --artifact or --invalidate-cache "
                  "covers (revert removes them): %s" % ", ".join(created), file=sys.stderr)
        rewritten = [path for path, why in inexact_products(entry["untracked"])
                     if why == "rewritten"]
        deleted = [path for path, why in inexact_products(entry["untracked"]) if why == "deleted"]
        if deleted:
            print("warning: the build deleted files that nothing backed up, so revert cannot give "
                  "them back: %s; next time pass %s" % (", ".join(deleted), protect_flags(deleted)),
                  file=sys.stderr)
        compiled = [path for path in rewritten if build_product(path, build_trees(build))]
        for paths, fate in ((compiled, "it removes them, the next build makes them again"),
                            ([path for path in rewritten if path not in compiled],
                             "it leaves them as the build wrote them")):
            if paths:
                print("warning: the build rewrote files that nothing backed up, so revert cannot "
                      "give them back byte-exact (%s): %s; next time pass %s"
                      % (fate, ", ".join(paths), protect_flags(paths)), file=sys.stderr)
        here = tool_at(state)
        if status is None:
            raise OverlayError("E402", "the build command timed out after %.1fs and was killed; "
                               "the patch stays applied: run `%s update --timeout SECONDS` to "
                               "build again with more time, or `%s revert`" % (seconds, here, here))
        if status != 0:
            raise OverlayError("E401", "the build command exited with status %d after %.1fs; the "
                               "patch stays applied for inspection: fix the patch or the source, "
                               "then run `%s update`, or run `%s revert`"
                               % (status, seconds, here, here))
        missing = [shown(record["path"]) for record in entry["artifacts"]
                   if record["built_sha256"] is None]
        if noop and missing:
            raise OverlayError("E404", "the build finished in %.1fs and changed no --artifact: %s "
                               "does not exist; the patch stays applied for inspection: run `%s "
                               "revert`, then apply again with the --artifact the build writes "
                               "(or check --build-cmd and --build-cwd)"
                               % (seconds, ", ".join(missing), here))
        if noop:
            what = ("the build finished in %.1fs but changed no --artifact (%s): the patch is not "
                    "in them; it stays applied for inspection: " % (seconds, ", ".join(
                        record["path"] for record in entry["artifacts"])))
            ahead = self.dated_after_the_patch()
            if ahead:
                raise OverlayError("E404", what + "%s; set the clock right (or `touch` the "
                                   "install's files to now), then run `%s update`, or run `%s "
                                   "revert`" % (ahead, here, here))
            if headers_build_ext_skips(build["cmd"], entry):
                raise OverlayError("E404", what + "setuptools' build_ext rebuilds an extension "
                                   "when one of its sources changed, not for a header it "
                                   "includes: run `%s revert`, then apply again with --build-cmd %s"
                                   % (here, shell_quote(build["cmd"] + " --force")))
            raise OverlayError("E404", what + "if the build skipped it (a compile error that the "
                               "build script let pass), fix the patch or the source and run `%s "
                               "update`; else check --build-cmd, --build-cwd and "
                               "--invalidate-cache, then run `%s revert`" % (here, here))
        print("build finished in %.1fs" % seconds)
        return 0

    def dated_after_the_patch(self) -> Optional[str]:
        """An artifact dated after the patched sources were written: the
        clock is behind the install's timestamps, so a build that compares
        them (make) finds nothing newer to rebuild.  None when there is none."""
        try:
            written_at = max(os.stat(record["path"]).st_mtime for record in self.sources)
        except (OSError, ValueError):
            return None
        for record in self.artifacts:
            try:
                dated = os.stat(record["path"]).st_mtime
            except OSError:
                continue
            if dated > written_at:
                return ("%s is dated %s, after the patched source %s was written: this "
                        "machine's clock is behind the install's timestamps, so the build found "
                        "nothing newer to rebuild" % (record["path"], time.strftime(
                            "%Y-%m-%d %H:%M:%S", time.localtime(dated)), self.sources[0]["path"]))
        return None

    def update(self, contents: Dict[str, Optional[bytes]], timeout: Optional[float]) -> None:
        """Swap the new patched `contents` in and build again.  This build is
        compared with the tree just before it: what was made or written since
        the last build (results, notes, another entry's products) is not this
        entry's."""
        state, entry = self.state, self.record
        for record in entry["sources"]:
            if record["path"] not in contents:
                continue
            # Journaled before the write; until it lands, the old patched
            # content is as much ours as the new one.
            record["previous_patched_sha256"] = record.get("patched_sha256")
            record["patched_sha256"] = None if contents[record["path"]] is None else \
                hashlib.sha256(contents[record["path"]]).hexdigest()
        if entry["build"] is not None:
            entry["earlier_untracked"] = untracked_products(state, entry)
            entry["builds"] = entry.get("builds", 1) + 1
            back_up_originals(state, self.journal, entry,
                              write_prebuild_scan(state, entry, "build_scan"))
            entry["untracked"] = None
            entry.pop("links_seen", None)
            if timeout is not None:
                entry["build"]["timeout"] = timeout
        self.enter(self.APPLYING if entry["build"] is not None else entry["state"])
        for record in entry["sources"]:
            path = record["path"]
            if path in contents and file_sha256(path) != record["patched_sha256"]:
                if contents[path] is None:
                    remove_file(path)
                else:
                    put_file(path, {"mode": record.get("mode", 0o644)}, data=contents[path])
        print("state: %s" % state.root, flush=True)
        if entry["build"] is not None:
            self.build()

    # -- revert

    @property
    def files(self) -> List[dict]:
        return entry_files(self.record)

    def drifted_sources(self) -> List[str]:
        """Sources changed by someone else after the apply (neither original
        nor patched).  A source that is gone (a build that removed its
        directory) is no one's edit: restoring it loses nothing."""
        changed = []
        for record in self.sources:
            current = file_sha256(record["path"])
            if current is not None and current not in (record.get("sha256"),
                                                       record.get("patched_sha256"),
                                                       record.get("previous_patched_sha256")):
                changed.append(record["path"])
        return changed

    def check_restorable(self) -> None:
        """Everything a revert of the entry needs, checked before anything changes."""
        state = self.state
        for record in self.files:
            path = record["path"]
            if os.path.isdir(path) and not os.path.islink(path):
                # Someone's directory: a revert never removes one wholesale.
                raise OverlayError("E504", "%s is now a directory where the overlay %s a file; "
                                   "nothing was reverted: move it away by hand, then run revert "
                                   "again" % (path, "restores" if record["present"] else "removes"))
            if record["present"]:
                backup = state.state_path(record["backup"])
                if not os.path.lexists(backup):
                    raise OverlayError("E503", "the backup of %s is missing from %s; nothing was "
                                       "changed: restore that file by hand, then remove entry %d "
                                       "from the journal" % (record["path"], state.root, self.id))
                if not stat.S_ISREG(os.lstat(backup).st_mode):
                    raise altered_backup(record["path"], backup, "a regular file (a symlink, "
                                         "directory or special file)")
        turned = set(self.links_the_build_made())
        for path in [record["path"] for record in self.files] + [
                cache["path"] for cache in self.caches] + [
                product["path"] for product in self.untracked or []]:
            link = symlink_on_the_way(path)
            if link and link not in turned:
                raise path_changed(path, link,
                                   "a symlink" if os.path.islink(link) else "no directory")
        for cache in self.caches:
            archive = state.state_path(cache["backup"])
            if not cache["present"] or not os.path.lexists(archive):
                continue  # absent: put back by an earlier, interrupted revert
            if cache["method"] == "rename" and not stat.S_ISDIR(os.lstat(archive).st_mode):
                raise altered_backup(cache["path"], archive, "a directory (a symlink or a file)")
            if cache["method"] == "tar":
                if not stat.S_ISREG(os.lstat(archive).st_mode):
                    raise altered_backup(cache["path"], archive, "a regular file (a symlink, "
                                         "directory or special file)")
                with open_snapshot(archive) as tar:
                    checked_members(archive, tar)

    def install_gone(self) -> Optional[str]:
        """Why the install the entry patched is no longer there (the folder
        of a source, as the apply or the last build left it, removed or
        replaced since, as pip's upgrade and uninstall do), or None.  What
        the backups hold is the old install's: nothing of it is written into
        the new one.  A build that did not finish tells nothing (it may have
        removed the folder itself), and a symlink in the folder's place is
        E505's."""
        if self.phase == self.APPLYING:
            return None
        for record in self.sources:
            if record.get("folder") is None:  # the build removed it, or a journal of 1.0
                continue
            folder = os.path.dirname(record["path"])
            try:
                st = os.lstat(folder)
            except (FileNotFoundError, NotADirectoryError):
                return "%s is gone since the apply (the install was removed)" % folder
            if record["present"] and record.get("patched_sha256") is not None \
                    and not os.path.lexists(record["path"]):
                # removed file by file, as pip uninstalls: its claim kept the folder
                return ("%s is gone since the apply (the install was removed)"
                        % record["path"])
            if not stat.S_ISDIR(st.st_mode) or file_sha256(record["path"]) in (
                    record.get("patched_sha256"), record.get("previous_patched_sha256")):
                continue  # the patch still stands: this is the folder it was applied to
            # A new folder can reuse the inode of one removed before it: the
            # claim written beside the source at the apply tells them apart
            # (unless a revert of ours that stopped halfway removed it).
            ours = (read_claim(record["path"]) or {}).get("state") == self.state.root \
                or self.journal.get("reverting")
            if [st.st_dev, st.st_ino] != record["folder"] or not ours:
                return ("%s is another folder than the one patched (the install was replaced, "
                        "as an upgrade does)" % folder)
        return None

    def close(self) -> None:
        """Drop the entry of an install that is gone (install_gone), writing
        nothing into what stands there now; a cache outside it comes back."""
        state, journal = self.state, self.journal
        self.stop_leftover_build()
        for path in self.claimed():
            drop_claim(state, path)
        folders = [os.path.dirname(record["path"]) for record in self.sources]
        for cache in self.caches:
            if not any(is_within(cache["path"], folder) for folder in folders):
                self.restore_cache(cache)
        journal["entries"].remove(self.record)
        if not journal["entries"]:
            journal["next_id"] = 1
        state.save(journal)
        remove_path(os.path.join(state.root, "backups", str(self.id)))

    def links_the_build_made(self) -> List[str]:
        """The folders that the entry's completed build turned into symlinks
        (out -> out-1) and that are still what it left: undone before the
        files under them come back.  One turned after the build is E505's."""
        return sorted(path for path, identity in (self.folders_turned or {}).items()
                      if seen(path) == identity)

    def folders_turned_links(self) -> List[str]:
        """Folders of the build directory that the scan before the first
        build saw and that are symlinks now."""
        trees = build_trees(self.build_record)
        return sorted(path for path, info in (prebuild_scan(self.state, self.record) or {}).items()
                      if isinstance(info, list) and info[:1] == ["d"] and os.path.islink(path)
                      and any(is_within(path, tree) for tree in trees))

    def running_build(self) -> Optional[dict]:
        """The journaled build process of the entry when it still runs here."""
        process = (self.build_record or {}).get("process")
        if process and owner_liveness(process) == "live" and group_alive(process["pid"]):
            return process
        return None

    def stop_leftover_build(self) -> None:
        """A build whose run was killed goes on writing into the tree: stop its
        process group before restoring.  A leader with another start time is
        another process that reuses the pid: its group is left alone."""
        process = (self.build_record or {}).get("process")  # its fields checked on load
        if process is None or process["host"] != host_name():
            return
        pid = process["pid"]
        if pid_exists(pid) and owner_liveness(process) != "live":
            return  # the pid is another process's now
        if not group_alive(pid):
            return
        print("stopping the build that entry %d left running (process group %d)" % (self.id, pid),
              file=sys.stderr)
        stop_process_group(pid)

    def changed_since_build(self, products: List[dict]) -> List[str]:
        """What the entry's last completed build left and someone changed
        since (a library upgraded, a file edited, a link changed): not the
        build's any more.  What an interrupted revert already put back or
        removed is no change."""
        kept = [record["path"] for record in self.protected
                if not unchanged_since_build(record)
                and seen(record["path"]) != record.get("identity")
                and file_sha256(record["path"]) not in (record.get("sha256"),
                                                        record.get("built_sha256", ""))]
        return kept + [product["path"] for product in products
                       if product["kind"] != "d" and os.path.lexists(product["path"])
                       and not unchanged_since_build(product)]

    def rewritten_originals(self) -> List[dict]:
        """After a run that died during its build: the pre-existing files
        copied before it that are now neither the original nor what an
        earlier build left (a rewrite by that build, or the caller's edit
        since; no record tells which)."""
        return [{"path": record["path"], "kind": "f", "created": False}
                for record in self.protected if record["role"] == ORIGINAL
                and os.path.lexists(record["path"]) and file_sha256(record["path"]) not in
                (record["sha256"], record.get("built_sha256", ""))]

    def set_aside_build_leftovers(self, products: List[dict], rewrites: List[dict]
                                  ) -> Tuple[List[dict], Tuple[str, str]]:
        """The run died during its build: what appeared in the build directory
        since it started may be the build's or the caller's own work, and so
        may the `rewrites` of pre-existing files that were copied: moved aside
        into leftovers/ (the copy is put back).  A pre-existing file that was
        not copied stays where it is, named as not byte-exact.  Returns the
        products to move aside and where."""
        products = [product for product in products if product["created"]]
        # Entry numbers start again once nothing is applied: an earlier run's folder stays whole.
        first = folder = os.path.join(self.state.root, "leftovers", str(self.id))
        number = 1
        while os.path.lexists(folder):
            number += 1
            folder = "%s-%d" % (first, number)
        aside = (os.path.commonpath(build_trees(self.build_record)), folder)
        moved = sorted(os.path.relpath(p["path"], aside[0]) for p in products + rewrites
                       if p["kind"] != "d")
        print("entry %d: the run stopped before it recorded what its build made; %d file(s) "
              "that appeared or changed in %s since the build began (its products, or your own "
              "edits) are moved to %s: %s%s"
              % (self.id, len(moved), aside[0], aside[1], ", ".join(moved),
                 "; the copies of %s taken before the build are put back" % ", ".join(
                     os.path.relpath(p["path"], aside[0]) for p in rewrites) if rewrites else ""),
              file=sys.stderr)
        remove_products(rewrites, aside)
        return products, aside

    def revert(self, keep_untracked: bool = False,
               force: bool = False) -> List[Tuple[str, str]]:
        """Give back what the entry changed and drop it from the journal (it
        may be half applied; idempotent: safe to run again after a crash);
        returns the files that are not back byte-exact, as (path, why):
        rewritten or deleted without a backup, or kept because they changed
        after the build (`force` restores and removes those all the same)."""
        state, journal = self.state, self.journal
        self.stop_leftover_build()
        turned = self.links_the_build_made()
        found = [product for product in untracked_products(state, self.record)
                 if product["path"] not in turned]
        products = [] if keep_untracked else found
        mine = {id(record) for record in self.files + found}
        ours = [record for record in still_ours(journal) if id(record) not in mine]
        kept = []
        completed = self.untracked is not None  # the entry's last build completed
        if completed and not force:
            kept = self.changed_since_build(products)
            products = [product for product in products if product["path"] not in set(kept)]
        aside = None
        rewrites = [] if completed else self.rewritten_originals()
        if not completed and (products or rewrites):
            products, aside = self.set_aside_build_leftovers(products, rewrites)
        if aside is None:
            # A rewritten file that is no build product and was not copied (a
            # version file over the budget) stays as the build wrote it: only a
            # stale patched object or program must not be linked or run again.
            products = [product for product in products if product["created"]
                        or product["kind"] == "d"
                        or build_product(product["path"], build_trees(self.build_record))]
        for path in self.claimed():  # a folder the build turned into a link took its claims
            drop_claim(state, os.path.join(os.path.realpath(os.path.dirname(path)),
                                           os.path.basename(path)))
        for link in turned:  # the folder comes back, and the files restored into it
            remove_file(link)
            os.mkdir(link)
        held = self.held_by_others([record["path"] for record in self.files]
                                   + [product["path"] for product in products])
        products = [product for product in products if product["path"] not in held]
        failures = []
        keep = set(kept) | set(held)
        for record in self.files:
            if record["path"] in keep or record.get("in_cache"):
                continue  # in a cache: it comes back whole with it below
            try:
                restore_file(state, record)
                remove_file(temp_beside(record["path"]))
            except OSError as exc:
                failures.append("%s (%s)" % (record["path"], exc.strerror))
        for cache in self.caches:
            try:
                self.restore_cache(cache)
            except OSError as exc:
                failures.append("%s (%s)" % (cache["path"], exc.strerror))
        if failures:  # the entry stays in the journal: the next revert finishes it
            raise OverlayError("E601", "could not write %s while reverting; the journal keeps what "
                               "is left: fix the cause and run `%s revert` again"
                               % (", ".join(failures), tool_at(state)))
        remove_products(products, aside)
        self.remove_jit_leftovers()
        kept += restore_build_dir_links(state, self.record, force)
        restore_build_dir_mtimes(state, self.record)
        for directory, mtime_ns in sorted(self.dirs.items(), reverse=True):
            if os.path.isdir(directory) and not os.path.islink(directory):
                os.utime(directory, ns=(mtime_ns, mtime_ns), follow_symlinks=False)
        journal["entries"].remove(self.record)
        if len(journal["entries"]) > 0:
            settle_after_build(journal)
        else:
            journal["next_id"] = 1  # numbers start again once nothing is applied
        state.save(journal)
        remove_path(os.path.join(state.root, "backups", str(self.id)))
        if ours:  # after the backups went: a file restored as a link to one had its ctime set
            for record in ours:
                record["seen"] = seen(record["path"])
            state.save(journal)
        return inexact_products(found) + [(path, "kept") for path in sorted(set(kept))]

    def claimed(self) -> List[str]:
        """What the entry claims beside the file (claim_path): its sources
        and its artifacts outside a cache, where their folder exists."""
        return [record["path"] for record in self.sources + self.artifacts
                if not record.get("in_cache") and os.path.isdir(os.path.dirname(record["path"]))]

    def held_by_others(self, paths: List[str]) -> Dict[str, dict]:
        """The paths that another applied overlay holds (its source, which
        this entry's build saw change): a revert never writes over them."""
        held = {}
        for path in paths:
            holder = claim_holder(path, self.state)  # None where no claim lies beside it
            if holder is not None:
                held[path] = holder
                print("entry %d: left %s as it is: the overlay at %s holds it"
                      % (self.id, path, holder.get("state")), file=sys.stderr)
        return held

    def restore_cache(self, cache: dict) -> None:
        backup = self.state.state_path(cache["backup"])
        path = cache["path"]
        if not cache["present"]:
            remove_path(path)
            return
        if cache["method"] == "rename":
            if os.path.isdir(backup):
                remove_path(path)
                durable_rename(backup, path)
                os.utime(path, ns=(cache["mtime_ns"], cache["mtime_ns"]), follow_symlinks=False)
            return
        if not os.path.isfile(backup):
            return
        staging = temp_beside(path, "restore-%d" % self.id)
        remove_path(staging)
        extract_snapshot(backup, staging)
        remove_path(path)
        durable_rename(staging, path)

    def remove_jit_leftovers(self) -> None:
        """Remove from each JIT build directory the files that appeared since the
        apply and that only a build makes: build products, ninja's .ninja_lock,
        torch's empty `lock` (an older torch waits forever on a leftover one).
        Anything else that appeared there is named and kept."""
        if not self.jit:
            return
        try:
            with open(self.state.state_path(self.jit["scan"]), encoding="utf-8") as handle:
                before = json.load(handle)
        except (OSError, ValueError):
            return  # a scan that cannot be read proves nothing
        kept = []
        for directory in self.jit["directories"]:
            after, truncated = scan_tree(directory, scan_exclusions(self.state, self.record))
            if truncated:
                continue
            for path, info in sorted(after.items()):
                if info[0] != "f" or path in before:
                    continue
                name = os.path.basename(path)
                if build_product(path, build_trees(self.build_record)) or name == ".ninja_lock" \
                        or (name == "lock" and info[1] == 0):
                    remove_file(path)
                else:
                    kept.append(path)
        if kept:
            print("entry %d: kept %s: it appeared in the JIT build directory after the apply and "
                  "is no build product" % (self.id, ", ".join(kept)), file=sys.stderr)

    # -- status

    def in_words(self, tool_running: bool) -> str:
        build = self.build_record or {}
        took = "after %.1fs" % build["seconds"] if build.get("seconds") is not None else ""
        if self.phase == self.APPLIED:
            return "applied, without a build"
        if self.phase == self.BUILT:
            return "built (the build exited 0 %s)" % took
        if self.phase == self.BUILT_NOTHING:
            return "applied, but its build changed no artifact (exited 0 %s)" % took
        if self.phase == self.BUILD_FAILED:
            if build.get("rc") is None:
                return "applied, but its build timed out %s and was killed" % took
            return "applied, but its build failed with status %s %s" % (build["rc"], took)
        running = self.running_build()
        if running:
            return "building: build pid %d, process group %d, running since %s%s" % (
                running["pid"], running["pid"], running.get("since", "an unrecorded time"),
                "" if tool_running else "; the overlay_setup.py process that started it is gone")
        if tool_running:
            return "being applied"
        if build.get("process"):
            return "interrupted during its build (the build no longer runs)"
        return "interrupted before its build"

    def status_lines(self, tool_running: bool) -> List[str]:
        lines = ["entry %d: %s" % (self.id, self.in_words(tool_running))]
        gone = self.install_gone()
        if gone:
            lines.append("  install gone: %s; revert closes the entry and writes nothing of the "
                         "old install" % gone)
        for record in self.files:
            lines.append("  %s %s%s" % (record["role"], record["path"],
                                        " (in the cache %s)" % record["in_cache"]
                                        if record.get("in_cache") else
                                        "" if record["present"] else " (absent before)"))
        lines += ["  cache %s (set aside by %s)" % (cache["path"], cache["method"])
                  for cache in self.caches]
        lines += ["  untracked build product %s" % product["path"]
                  for product in self.untracked or []]
        return lines

    def interrupted(self) -> Optional[str]:
        """What a run of this tool was doing to the entry when it stopped
        halfway (applying or building it), else None."""
        if self.phase != self.APPLYING:
            return None
        building = (self.build_record or {}).get("process")
        return "%s entry %d" % ("building" if building else "applying", self.id)


def native_entries(state: State, journal: dict) -> List[NativeEntry]:
    return [NativeEntry(state, journal, record) for record in journal["entries"]]


# ---------------------------------------------------------------- revert


def tree_digest(path: str) -> Optional[str]:
    """What a cache directory holds, by name, kind, size and mtime (cheap for
    a large cache, and a rebuild changes it); None when it is absent."""
    if not os.path.isdir(path) or os.path.islink(path):
        return None
    found, _ = scan_tree(path, [])
    return hashlib.sha256(json.dumps(sorted(found.items())).encode(
        "utf-8", "surrogateescape")).hexdigest()


def settle_after_build(journal: dict) -> None:
    """Record what every artifact and cache of the state's built entries
    holds after one of its builds or reverts (a later entry's build may
    rewrite an earlier entry's; reverting it puts the earlier build's back)."""
    for entry in journal["entries"]:
        if entry["build"] is None:
            continue
        for record in entry["artifacts"]:
            # The identity is taken before the hash, so that a write during it shows next time.
            identity = content_identity(record["path"])
            if identity is None or identity != record.get("after_build_identity"):
                record["after_build_sha256"] = content_sha256(record["path"])
            record["after_build_identity"] = identity
        for cache in entry["caches"]:
            cache["after_build_digest"] = tree_digest(cache["path"])


def rebuilt_since_apply(state: State, entries: List[dict]) -> List[str]:
    """Artifacts and caches changed since the state's last build.  After a
    build of this state that was interrupted (an apply or update killed in
    it) they hold what that build wrote, which no hash records: ours."""
    changed = []
    if any(entry["state"] == NativeEntry.APPLYING for entry in entries):
        return changed
    for entry in entries:
        for record in entry["artifacts"]:
            if "after_build_sha256" in record and content_identity(record["path"]) != record.get(
                    "after_build_identity") and content_sha256(record["path"]) not in (
                    record["after_build_sha256"], record["sha256"]):  # or half reverted
                changed.append(record["path"])
        for cache in entry["caches"]:
            put_back = cache["present"] and cache["method"] == "rename" and not os.path.lexists(
                state.state_path(cache["backup"]))  # by a revert that was killed: revert skips it
            if "after_build_digest" in cache and not put_back and tree_digest(
                    cache["path"]) not in (cache["after_build_digest"], cache.get("digest")):
                changed.append(cache["path"])
    return sorted(set(changed))


def altered_backup(path: str, backup: str, what: str) -> OverlayError:
    return OverlayError("E203", "the backup of %s, %s, is not %s; the state directory was "
                        "altered, nothing was changed" % (path, backup, what))


def restore_file(state: State, record: dict) -> None:
    """Put one tracked file back as recorded: content, owner, mode, extended
    attributes, times, and for a hard-linked source its inode.  A file not
    touched since its backup is left alone."""
    path = record["path"]
    if not record["present"]:
        remove_file(path)
        return
    try:
        if file_identity(path) == record.get("identity"):
            return
    except OSError:
        pass
    if record.get("inode_backup"):
        restore_inode(state, record)
        return
    backup = state.state_path(record["backup"])
    try:
        same_fs = os.stat(backup).st_dev == os.stat(os.path.dirname(path)).st_dev
    except FileNotFoundError:  # the build removed the directory: put_file makes it again
        same_fs = False
    put_file(path, record, source=backup, link_ok=same_fs)


def restore_inode(state: State, record: dict) -> None:
    """Give a file with other hard links (a library uv links from its cache)
    its own inode back, so that every name of it holds the original again:
    the inode gets the copy's content back if the build wrote in place
    (through this name, so through all), and the name is linked to it again
    if the build replaced it."""
    path = record["path"]
    inode = state.state_path(record["inode_backup"])
    if file_sha256(inode) != record["sha256"]:
        mutation_point()
        fd = os.open(inode, os.O_WRONLY | os.O_TRUNC | os.O_NOFOLLOW)
        try:
            copy_sparse(state.state_path(record["backup"]), fd)
            set_metadata(fd, record)
            os.fsync(fd)
        finally:
            os.close(fd)
    try:
        same = os.path.samefile(path, inode) and not os.path.islink(path)
    except OSError:
        same = False
    if not same:
        put_file(path, record, source=inode, link_ok=True)


def remove_products(products: List[dict], aside: Optional[Tuple[str, str]] = None) -> None:
    """Remove the build's products; with `aside` (build directory, folder),
    move them into that folder instead, keeping their paths.  The folders
    the build removed are made again (their mtimes come back after)."""
    for product in products:
        path = product["path"]
        if product["kind"] != "d" and os.path.lexists(path) and not (
                os.path.isdir(path) and not os.path.islink(path)):
            if aside is None:
                remove_file(path)
                continue
            target = os.path.join(aside[1], os.path.relpath(path, aside[0]))
            os.makedirs(os.path.dirname(target), exist_ok=True)
            shutil.move(path, target)
    for product in sorted(products, key=lambda p: p["path"], reverse=True):
        if product["kind"] == "d" and product["created"] and os.path.isdir(product["path"]):
            try:
                os.rmdir(product["path"])
            except OSError:
                pass
    for product in products:
        if product["kind"] == "d" and product.get("deleted") and not os.path.lexists(
                product["path"]):
            os.makedirs(product["path"])


def build_product(path: str, trees: List[str]) -> bool:
    """The one rule for what a build makes: an object, library, depfile or
    program (by its name, or an ELF file), which a later build could link or
    run stale, or any file under the `build/` folder of a build directory in
    `trees` (where setuptools keeps its own)."""
    if PRODUCT_RE.search(os.path.basename(path)) or any(
            is_within(path, os.path.join(tree, "build")) for tree in trees):
        return True
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return False
    try:
        return os.read(fd, 4) == b"\x7fELF"
    except OSError:
        return False
    finally:
        os.close(fd)


def inexact_products(products: List[dict]) -> List[Tuple[str, str]]:
    """Files that were there before and that the build changed or deleted
    without a backup, as (path, why) for report_inexact."""
    return [(product["path"], "deleted" if product.get("deleted") else "rewritten")
            for product in products if not product["created"] and product["kind"] != "d"]


def still_ours(journal: dict) -> List[dict]:
    """The build products of the state's entries that are still what its
    builds and reverts left: what the next build or revert leaves there is
    ours too (one changed since, by hand or an upgrade, stays someone's)."""
    return [record for entry in journal["entries"]
            for record in (entry.get("protected") or []) + (entry.get("untracked") or [])
            if record.get("kind") != "d" and "seen" in record and unchanged_since_build(record)]


def unchanged_since_build(record: dict) -> bool:
    """Whether a file is still what the tool saw after the entry's last build
    (True when nothing was recorded: an entry without a completed build, or
    a journal of version 1.0)."""
    return "seen" not in record or seen(record["path"]) == record["seen"]


def remove_orphaned_backups(state: State, journal: dict) -> List[str]:
    """Remove the backup folders no journal entry names: a revert killed
    between its journal write and their removal leaves them (as does a run
    killed before its entry was journaled, when nothing was changed yet)."""
    try:
        names = os.listdir(state.backups)
    except FileNotFoundError:
        return []
    named = {str(entry["id"]) for entry in journal["entries"]}
    orphans = sorted((name for name in names if name not in named), key=lambda n: (len(n), n))
    for name in orphans:
        remove_path(os.path.join(state.backups, name))
    if not journal["entries"]:
        remove_path(state.backups)
    return orphans


def revert_all(state: State, journal: dict, force: bool,
               keep_untracked: bool) -> Tuple[List[str], List[str]]:
    """Switch the Python overlay off and restore every native entry in reverse
    order; returns what was done and the files not back byte-exact."""
    gone = {entry.id: entry.install_gone() for entry in native_entries(state, journal)}
    entries = [entry for entry in native_entries(state, journal) if not gone[entry.id]]
    for entry in entries:
        entry.check_restorable()
    if not force:
        for entry in entries:
            changed = entry.drifted_sources()
            if changed:  # --force on the older of two overlays would bring the newer back later
                raise OverlayError("E501", "%s was changed after the overlay was applied (neither "
                                   "the original nor the patched content); nothing was reverted: "
                                   "if another overlay patched it since, revert that one first; "
                                   "else run `%s revert --force` to restore the original "
                                   "anyway" % (changed[0], tool_at(state)))
        changed = rebuilt_since_apply(state, [entry.record for entry in entries])
        if changed:
            raise OverlayError("E509", "%s was changed after the overlay's build (neither the "
                               "original nor what that build made): another overlay or build "
                               "wrote it, and restoring it now would undo that; nothing was "
                               "reverted: revert the other one first, or run `%s revert "
                               "--force` to restore the original anyway"
                               % (changed[0], tool_at(state)))
    done: List[str] = []
    inexact: List[str] = []
    # A revert killed halfway is a crash whoever the owner is (interrupted()).
    journal["reverting"] = True
    state.save(journal)
    python = journal["python"]
    if python["modules"] or python["rebinds"]:
        done.append("Python overlay switched off (%d module(s), %d rebind(s))"
                    % (len(python["modules"]), len(python["rebinds"])))
        # The served configuration goes first: a crash in between leaves the
        # journal still listing the modules, so the next revert finishes it.
        journal["python"] = {"modules": {}, "rebinds": {}}
        write_python_overlay(state, journal)
        state.save(journal)
    remove_path(state.python)
    # What revert gives back is what lies in these directories (and each
    # file named): a build's write elsewhere, an install step's copy into a
    # prefix, is not seen, and is said not to be.
    trees = {path for entry in entries
             for path in build_trees(entry.build_record) + [cache["path"]
                                                            for cache in entry.caches]}
    checked = sorted([tree for tree in trees if not any(tree != other and is_within(tree, other)
                                                        for other in trees)]
                     + sorted({record["path"] for entry in entries
                               for record in entry.files
                               if not any(is_within(record["path"], tree) for tree in trees)}))
    for entry in reversed(native_entries(state, journal)):
        if gone[entry.id]:
            entry.close()
            done.append("entry %d closed: %s; nothing of the old install was written back"
                        % (entry.id, gone[entry.id]))
            continue
        inexact += entry.revert(keep_untracked, force)
        done.append("entry %d restored: %s" % (
            entry.id, shown_list([record["path"] for record in entry.sources])))
    if checked:
        done.append("checked %s; a build's writes outside %s (an install step into a prefix) "
                    "are not, unless named with --build-dir or --artifact"
                    % (shown_list(checked), "it" if len(checked) == 1 else "them"))
    del journal["reverting"]
    state.save(journal)
    remove_path(state.backups)
    return done, inexact


def protect_flags(paths: List[str]) -> str:
    return " ".join("--protect %s" % shell_quote(path) for path in paths)


def report_inexact(state: State, inexact: List[Tuple[str, str]]) -> None:
    """E506 for what the build rewrote or deleted with no backup, E510 for
    what changed after the build and was left as it is."""
    rewritten = [path for path, why in inexact if why == "rewritten"]
    deleted = [path for path, why in inexact if why == "deleted"]
    kept = [path for path, why in inexact if why == "kept"]
    if rewritten or deleted:
        paths = rewritten + deleted
        what = " and ".join(part for part in (
            "rewrote %s" % ", ".join(rewritten) if rewritten else "",
            "deleted %s" % ", ".join(deleted) if deleted else "") if part)
        print("overlay_setup: E506 not byte-exact: the build %s with no backup; the next "
              "build makes %s again (to keep %s next time, pass %s)"
              % (what, "it" if len(paths) == 1 else "them",
                 "it" if len(paths) == 1 else "them", protect_flags(paths)), file=sys.stderr)
    if kept:
        print("overlay_setup: E510 kept %s: changed after the overlay's build (not what the "
              "build left, nor the original), so it is not the overlay's to restore or remove; "
              "run `%s revert --force` to restore or remove it all the same"
              % (", ".join(kept), tool_at(state)), file=sys.stderr)


# ---------------------------------------------------------------- commands


def read_input(path: str, what: str, hint: str = "") -> bytes:
    """The bytes of a file the caller names, or E102 saying why it cannot be
    read (`what` names the argument, `hint` says what to pass instead).  At
    most INPUT_LIMIT bytes are read: /dev/zero is no source file."""
    try:
        with open(path, "rb") as handle:
            data = handle.read(INPUT_LIMIT + 1)
    except OSError as exc:
        raise UsageError("E102", "cannot read %s%s (%s)%s" % (what, path, exc.strerror, hint))
    if len(data) > INPUT_LIMIT:
        raise UsageError("E102", "%s%s is larger than %d MiB (or endless)%s"
                         % (what, path, INPUT_LIMIT >> 20, hint))
    return data


def read_patch(args: argparse.Namespace) -> bytes:
    """The bytes of PATCH, read once: each round of a trial applies them
    again, and a piped patch (`trial <(git diff)`) can be read only once."""
    if getattr(args, "patch_bytes", None) is None:
        args.patch_bytes = read_input(args.patch, "patch ", "; pass a unified diff")
    return args.patch_bytes


LEGACY_STATE = ".overlay"  # version 1.0's default state directory, in the current directory


def state_root(args: argparse.Namespace) -> str:
    """--state, else $OVERLAY_STATE, else the default state directory of the
    current directory; an overlay that version 1.0 applied from here (in
    ./.overlay) is found until it is reverted."""
    given = args.state or os.environ.get("OVERLAY_STATE")
    if given:
        return os.path.normpath(os.path.abspath(given))
    here = os.getcwd()
    default = default_state_dir(here)
    legacy = os.path.join(here, LEGACY_STATE)
    if not State(default).exists() and (os.path.isfile(registry_record(legacy))
                                        or (os.path.isdir(legacy) and holds_something(
                                            State(legacy)))):
        return legacy
    return default


def open_state(args: argparse.Namespace) -> State:
    state = State(state_root(args))
    state.check_safe()
    return state


class Locked:
    """`with Locked(state, 'cmd') as journal:` creates, locks and loads the state."""

    def __init__(self, state: State, command: str, create: bool = True):
        self.state = state
        self.command = command
        self.create = create

    def __enter__(self) -> dict:
        try:
            if self.create:
                self.state.create()
            self.state.lock(self.command)
        except OSError as exc:
            if self.create:
                raise unwritable_state(self.state, exc)
            raise
        with contextlib.suppress(OSError):
            self.state.release_space()  # what a run killed in its build held
        try:
            if self.create and not self.state.exists():
                self.state.save(empty_journal())
            journal = self.state.load()
            if not anything_applied(journal):  # a revert killed after its last entry
                journal.pop("reverting", None)
            if self.create:  # after the journal exists, before the install changes
                register(self.state)
            return journal
        except OSError as exc:
            self.state.unlock()
            if self.create:
                raise unwritable_state(self.state, exc)
            raise
        except BaseException:
            self.state.unlock()
            raise

    def __exit__(self, *exc_info) -> None:
        try:
            if self.create and self.state.exists() and not anything_applied(self.state.load()):
                unregister(self.state)
        except (OverlayError, OSError):
            pass  # registered it stays, which is the safe side
        finally:
            self.state.unlock()


def unwritable_state(state: State, exc: OSError) -> OverlayError:
    """Refused before the install changes: without a journal nothing may."""
    if exc.errno in (errno.ENOSPC, errno.EDQUOT, errno.EIO):  # the place is right, the disk not
        return OverlayError("E601", "could not write %s (%s); nothing was changed: fix the "
                            "cause and run the command again" % (written(exc), exc.strerror))
    where = "" if written(exc) == state.root else "%s: " % written(exc)
    return OverlayError("E210", "cannot write the state directory %s (%s%s); nothing was "
                        "changed: pass --state DIR on a writable filesystem, or set "
                        "XDG_STATE_HOME to a writable directory for the default (now %s)"
                        % (state.root, where, exc.strerror or exc, state_home()))


def cmd_init(args: argparse.Namespace) -> int:
    owner = resolve_owner(args.owner_pid)
    state = open_state(args)
    check_python_state(state)
    with Locked(state, "init") as journal:
        claim_owner(state, journal, owner)
        state.save(journal)
        write_python_overlay(state, journal)
    print("overlay state ready at %s (owner %s)" % (state.root, describe_owner(journal["owner"])))
    return 0


def cmd_add_python(args: argparse.Namespace) -> int:
    check_module_name(args.module, "MODULE")
    owner = resolve_owner(args.owner_pid)
    state = open_state(args)
    check_python_state(state)
    content = read_input(args.file, "", "; pass a readable Python file")
    with Locked(state, "add-python") as journal:
        claim_owner(state, journal, owner)
        stage_python_module(state, journal, args.module, content, None,
                            os.path.abspath(args.file))
        state.save(journal)
        write_python_overlay(state, journal)
    print("module %s now served from a copy of %s taken now (edit the file later and it is not "
          "seen) to Python processes started after `eval \"$(%s env)\"`"
          % (args.module, shown(os.path.abspath(args.file)), tool_at(state)))
    print("state: %s" % state.root)
    return 0


def cmd_rebind(args: argparse.Namespace) -> int:
    for spec, what in ((args.target, "TARGET"), (args.replacement, "REPLACEMENT")):
        module, colon, attr = spec.partition(":")
        if not colon or not re.match(r"^[A-Za-z_][A-Za-z0-9_]*$", attr):
            raise UsageError("E105", "%s %r must look like pkg.mod:attr" % (what, spec))
        check_module_name(module, what)
    owner = resolve_owner(args.owner_pid)
    state = open_state(args)
    check_python_state(state)
    with Locked(state, "rebind") as journal:
        claim_owner(state, journal, owner)
        if args.target in journal["python"]["rebinds"]:
            raise OverlayError("E103", "%s is already rebound; run `%s revert` first"
                               % (args.target, tool_at(state)))
        journal["python"]["rebinds"][args.target] = args.replacement
        state.save(journal)
        write_python_overlay(state, journal)
    print("%s is replaced by %s when %s is imported in Python processes started after "
          "`eval \"$(%s env)\"`" % (args.target, args.replacement,
                                     args.target.partition(":")[0], tool_at(state)))
    print("state: %s" % state.root)
    return 0


def cmd_env(args: argparse.Namespace) -> int:
    state = open_state(args)
    check_python_state(state)
    if not os.path.isfile(os.path.join(state.site, "sitecustomize.py")):
        raise OverlayError("E207", "no overlay at %s; run `%s init` first"
                           % (state.root, tool_at(state)))
    value = overlay_environment(state)["PYTHONPATH"]
    if args.format == "json":
        print(json.dumps({"PYTHONPATH": value, "OVERLAY_STATE": state.root}, sort_keys=True))
    else:
        print("export PYTHONPATH=%s" % shell_quote(value))
        print("export OVERLAY_STATE=%s" % shell_quote(state.root))
    return 0


def shell_quote(text: str) -> str:
    if re.match(r"^[A-Za-z0-9_@%+=:,./-]+$", text):
        return text
    return "'" + text.replace("'", "'\"'\"'") + "'"


def require_build_choice(args: argparse.Namespace) -> None:
    if args.build_cmd is None and not args.no_build and not args.dry_run:
        raise UsageError("E109", "pass --build-cmd CMD (the install's own build) or --no-build; "
                         "--dry-run lists the build systems found near the source")


def native_options(args: argparse.Namespace) -> Tuple[List[str], List[str], Optional[dict]]:
    artifacts = [require_abs_normal(path, "--artifact") for path in args.artifact]
    caches = [require_abs_normal(path, "--invalidate-cache") for path in args.invalidate_cache]
    if args.timeout is not None and not (math.isfinite(args.timeout) and args.timeout > 0):
        raise UsageError("E109", "--timeout must be a positive, finite number of seconds (got %g)"
                         % args.timeout)
    if args.build_cwd is not None:
        args.build_cwd = require_abs_normal(args.build_cwd, "--build-cwd")
    for path in args.protect:
        require_abs_normal(path, "--protect")
        if not os.path.lexists(path):
            raise OverlayError("E102", "--protect %s does not exist; pass an existing build "
                               "product or a directory of them" % path)
        if os.path.islink(path) or not (os.path.isfile(path) or os.path.isdir(path)):
            raise OverlayError("E104", "--protect %s is a symlink or special file; pass the file "
                               "or directory itself" % path)
    build = None
    if args.build_cmd is not None:
        build = {"cmd": args.build_cmd, "cwd": args.build_cwd or os.getcwd(),
                 "timeout": args.timeout, "rc": None, "seconds": None}
        build["distributions"] = artifact_distributions(artifacts, caches)
        build["trees"] = build_trees_of(args, build["cwd"], build["distributions"], artifacts,
                                        caches)
    elif args.build_dir:
        raise UsageError("E109", "--build-dir names where --build-cmd writes; pass --build-cmd "
                         "too, or drop --build-dir")
    return artifacts, caches, build


def build_trees_of(args: argparse.Namespace, cwd: str, distributions: List[str],
                   artifacts: List[str], caches: List[str]) -> List[str]:
    """The directories --build-cmd writes in: the --build-dir given, else
    those build_directories reads from it, the folders of the artifacts'
    installed distributions, and each artifact's own folder (an install's
    prefix that the command does not show), but one that is a JIT's build
    directory (which jit_directories handles) or lies in a cache; one
    inside another is left out (scanning it is scanning the other)."""
    trees = ([require_abs_normal(path, "--build-dir") for path in args.build_dir] or
             build_directories(args.build_cmd, cwd)) + [
        tree for dist_info in distributions for tree in distribution_trees(dist_info)]
    trees += [os.path.dirname(path) for path in artifacts
              if not any(is_within(path, tree) for tree in trees + caches)
              and not os.path.isfile(os.path.join(os.path.dirname(path), "build.ninja"))]
    return sorted(tree for tree in set(trees)
                  if not any(tree != other and is_within(tree, other) for other in trees))


def cmd_add_native(args: argparse.Namespace) -> int:
    source = require_abs_normal(args.source, "--source")
    require_build_choice(args)
    artifacts, caches, build = native_options(args)
    patched = read_input(args.patched, "--patched ", "; pass the patched file")
    if os.path.exists(source) and not os.path.isfile(source):
        raise UsageError("E102", "--source %s is a %s, not a file; pass the installed file to patch"
                         % (source, "directory" if os.path.isdir(source) else "special file (fifo, "
                            "socket or device)"))
    if not os.path.isfile(source):
        raise UsageError("E102", "--source %s does not exist; pass the installed file to patch "
                           "(or use `apply` with a patch that creates it)" % source)
    state = open_state(args)
    check_state_outside_build(state, build)
    plan = NativePlan(state, args, [(source, patched)], artifacts, caches, build)
    if args.dry_run:
        return plan.dry_run()
    owner = resolve_owner(args.owner_pid)
    with Locked(state, "add-native") as journal:
        claim_owner(state, journal, owner)
        plan.check(journal)
        entry = plan.run(journal, "add-native")
    here = tool_at(state)
    if build is None:
        print("entry %d applied without a build: %s; run `%s revert` to take it back"
              % (entry.record["id"], shown(source), here))
    else:
        print("entry %d applied: %s; run `%s verify-native`, measure, then `%s revert`"
              % (entry.record["id"], shown(source), here, here))
    return 0


def where_the_diff_fits(relative: str, root: str, strip: int) -> str:
    """The --root or -p under which a path of a diff names an existing file
    (a git diff names paths from the repository's top, wherever it ran)."""
    directory = root
    while directory != os.path.dirname(directory):
        directory = os.path.dirname(directory)
        if os.path.isfile(os.path.join(directory, relative)):
            return "pass --root %s" % shell_quote(directory)
    if "/" in relative and os.path.isfile(os.path.join(root, relative.split("/", 1)[1])):
        return "pass -p %d" % (strip + 1)
    return "pass --root at the directory the diff was made in, and the -p that fits its paths"


def already_applied(args: argparse.Namespace, name: str, target: str, file_patch: FilePatch,
                    current: bytes) -> None:
    """A patch whose hunks do not apply because it is applied already, as
    an entry of this state directory: say so (E103) instead of E302; a file
    that another applied overlay of this user holds is named (E120)."""
    state = open_state(args)
    check_claims(state, [target], [], [])
    if not state.exists():
        return
    for entry in state.load()["entries"]:
        for record in entry["sources"]:
            if record["path"] != target or not record["present"]:
                continue
            with open(state.state_path(record["backup"]), "rb") as handle:
                original = handle.read()
            try:
                patched = apply_hunks(file_patch, original, name)
            except OverlayError:
                continue
            if patched == current:
                raise OverlayError("E103", "%s is already applied as entry %d (%s); nothing was "
                                   "written: to change that entry, run `%s update PATCH` with a "
                                   "patch against the original, or `%s revert` first"
                                   % (name, entry["id"], target, tool_at(state), tool_at(state)))


def cmd_apply(args: argparse.Namespace) -> int:
    root = require_abs_normal(args.root or os.getcwd(), "--root")
    if args.p < 0:
        raise UsageError("E109", "-p must be 0 or more")
    artifacts, caches, build = native_options(args)
    text = read_patch(args).decode("utf-8", "surrogateescape")
    name = os.path.basename(args.patch)
    file_patches = parse_patch(text, args.p, name)
    natives: List[Tuple[str, Optional[bytes]]] = []
    modes: Dict[str, int] = {}
    python_files: List[dict] = []
    for file_patch in file_patches:
        relative = file_patch.path
        suffix = os.path.splitext(relative)[1]
        base = os.path.basename(relative)
        if base in BUILD_FILE_NAMES or suffix in BUILD_FILE_SUFFIXES:
            suffix = ""  # patched in place and reverted as a source is, setup.py too
        elif base == "build.ninja":
            raise OverlayError("E303", "%s: %s is written by the build system (CMake, Meson, "
                               "torch's extension loader); nothing was written: patch what "
                               "generates it instead" % (name, relative))
        elif suffix not in NATIVE_SUFFIXES + (".py",):
            raise OverlayError("E303", "%s: %s is neither a compiled source (%s), a build file "
                               "(%s) nor a .py file; nothing was written: leave it out of the "
                               "patch" % (name, relative, " ".join(NATIVE_SUFFIXES), " ".join(
                                   BUILD_FILE_NAMES + tuple("*" + s for s in
                                                            BUILD_FILE_SUFFIXES))))
        target = os.path.join(root, relative)
        if file_patch.old is not None and not os.path.lexists(target):
            raise OverlayError("E302", "%s: %s is not under %s, where the diff's paths are read "
                               "from (--root, default the current directory, after -p %d); "
                               "nothing was written: %s" % (name, relative, root, args.p,
                                                            where_the_diff_fits(relative, root,
                                                                                args.p)))
        if not os.path.isdir(os.path.dirname(target)):
            raise UsageError("E102", "%s: the directory of %s does not exist under %s; create "
                               "it first (the overlay does not create directories)"
                               % (name, relative, root))
        if not is_within(os.path.realpath(os.path.dirname(target)), os.path.realpath(root)):
            raise OverlayError("E304", "%s: the directory of %s is a symlink that leads out of "
                               "the --root directory %s; nothing was written"
                               % (name, relative, root))
        if os.path.islink(target):
            raise OverlayError("E104", "%s: %s is a symlink; patch the file it points to"
                               % (name, target))
        original = None
        if os.path.isfile(target):
            with open(target, "rb") as handle:
                original = handle.read()
        try:
            result = apply_hunks(file_patch, original, name)
        except OverlayError as exc:
            if exc.code == "E302" and original is not None:
                already_applied(args, name, target, file_patch, original)
            raise
        if suffix == ".py" and file_patch.mode is not None and (
                original is not None or file_patch.mode != 0o644):
            raise OverlayError("E305", "%s: %s changes mode to %s, but a .py file is overlaid by "
                               "its content alone: leave the mode change out of the patch"
                               % (name, relative, "100%o" % file_patch.mode))
        if file_patch.mode is not None and result is not None:
            modes[target] = file_patch.mode if original is None else \
                git_mode_change(os.stat(target).st_mode, file_patch.mode)
        if suffix == ".py":
            python_files.append({"path": target, "content": result})
        else:
            natives.append((target, result))
    if natives:
        require_build_choice(args)  # a patch of .py files alone builds nothing
    if natives and not artifacts and build is not None:
        print("warning: no --artifact given; verify-native will have nothing to check",
              file=sys.stderr)
    state = open_state(args)
    if python_files:
        check_python_state(state)
    created = [file["path"] for file in python_files if not os.path.exists(file["path"])]
    for file in python_files:
        file["chain"], file["home"], file["package"] = package_chain(file["path"], created)
        if not MODULE_RE.match(file["chain"]):
            raise UsageError("E105", "%s: no import can name %s (module %r is not a dotted name "
                             "of identifiers); leave it out of the patch"
                             % (name, file["path"], file["chain"]))
    names = module_names(args.python, python_files, state, name) if python_files else []
    modules = [(module, file["content"], os.path.dirname(file["path"]) if file["package"] else None,
                file["path"]) for module, file in zip(names, python_files)]
    check_state_outside_build(state, build if natives else None)
    plan = NativePlan(state, args, natives, artifacts, caches, build, modes,
                      [(module, origin) for module, _, _, origin in modules])
    if args.dry_run:
        return plan.dry_run()
    owner = resolve_owner(args.owner_pid)
    with Locked(state, "apply") as journal:
        claim_owner(state, journal, owner)
        for module, _content, _package, _origin in modules:
            if module in journal["python"]["modules"]:
                raise OverlayError("E103", "module %s is already overlaid; run `%s revert` "
                                   "first" % (module, tool_at(state)))
        plan.check(journal)

        def python_update() -> None:
            for module, content, package_dir, origin in modules:
                stage_python_module(state, journal, module, content, package_dir, origin)
            if modules:
                state.save(journal)
                write_python_overlay(state, journal)

        entry = plan.run(journal, "apply", python_update, getattr(args, "in_trial", False))
    parts = []
    if entry is not None:
        parts.append("entry %d: %d native file(s)" % (entry.record["id"], len(natives)))
    in_trial = getattr(args, "in_trial", False)
    if modules:
        parts.append("%d Python module(s) overlaid (%s)%s" % (
            len(modules), ", ".join(module for module, _, _, _ in modules), "" if in_trial
            else ", seen by processes started after `eval \"$(%s env)\"`" % tool_at(state)))
    print("applied %s: %s%s" % (name, "; ".join(parts), "" if in_trial
                                else "; run `%s revert` to take it back" % tool_at(state)))
    return 0


def updated_contents(state: State, entry: dict, args: argparse.Namespace
                     ) -> Tuple[Dict[str, Optional[bytes]], List[str]]:
    """The new patched content of the entry's sources: from --patched, from
    a patch applied to the originals (the backups), or, with neither, what
    the sources hold now (fixed in place).  A patch replaces the whole
    change: a source it no longer changes goes back to its original (None:
    it was absent); those are returned too."""
    sources = {record["path"]: record for record in entry["sources"]}
    if args.patched is not None:
        if len(sources) != 1:
            raise UsageError("E109", "entry %d patches %d sources; pass a PATCH instead of "
                             "--patched" % (entry["id"], len(sources)))
        return {next(iter(sources)): read_input(args.patched, "--patched ",
                                                "; pass the patched file")}, []
    if args.patch is None:
        return {path: read_input(path, "", "; restore it, or run `%s revert`" % tool_at(state))
                for path in sources}, []
    root = require_abs_normal(args.root or os.getcwd(), "--root")
    name = os.path.basename(args.patch)
    text = read_patch(args).decode("utf-8", "surrogateescape")
    def original(record: dict) -> Optional[bytes]:
        if not record["present"]:
            return None
        with open(state.state_path(record["backup"]), "rb") as handle:
            return handle.read()
    patches = {}
    for file_patch in parse_patch(text, args.p, name):
        path = os.path.join(root, file_patch.path)
        record = sources.get(os.path.normpath(path))
        if record is None:
            raise OverlayError("E103", "%s: %s is not a source of entry %d (%s); apply it as a "
                               "change of its own" % (name, path, entry["id"],
                                                     ", ".join(sorted(sources))))
        patches[record["path"]] = file_patch
    contents = {path: original(record) for path, record in sources.items()
                if path not in patches}
    for path, file_patch in patches.items():
        result = apply_hunks(file_patch, original(sources[path]), name)
        if result is None:
            raise OverlayError("E303", "%s: %s is deleted by the patch; `update` only changes "
                               "content: revert and apply it instead" % (name, path))
        contents[path] = result
    return contents, sorted(path for path in sources if path not in patches)


def cmd_update(args: argparse.Namespace) -> int:
    if args.patch is not None and args.patched is not None:
        raise UsageError("E109", "pass a PATCH or --patched FILE, not both")
    if args.timeout is not None and not 0 < args.timeout < float("inf"):
        raise UsageError("E109", "--timeout must be a positive number of seconds")
    owner = resolve_owner(args.owner_pid)
    state = open_state(args)
    require_overlay(args, state, "update")
    with Locked(state, "update", create=False) as journal:
        claim_owner(state, journal, owner)
        natives = [entry for entry in journal["entries"]
                   if args.entry is None or entry["id"] == args.entry]
        if not natives:
            raise OverlayError("E103", "no native entry%s to update at %s; apply one first"
                               % ("" if args.entry is None else " %d" % args.entry, state.root))
        entry = natives[-1]
        if entry["build"] is not None and entry["state"] == NativeEntry.APPLYING:
            # The run is gone (we hold the lock): what appeared since its build
            # began cannot be told from the user's files, which revert moves
            # aside and a completed build would count as its own products.
            raise OverlayError("E211", "entry %d's last run stopped before its build finished, "
                               "so what appeared in %s since may be your own; a new build would "
                               "take it for its products: run `%s revert` (it stops the build "
                               "left running, moves those files aside and restores the rest), "
                               "then apply again" % (entry["id"], ", ".join(build_trees(
                                   entry["build"])), tool_at(state)))
        contents, back = updated_contents(state, entry, args)
        NativeEntry(state, journal, entry).update(contents, args.timeout)
    print("entry %d updated: %s; %sthe originals stay backed up for `%s revert`"
          % (entry["id"], ", ".join(map(shown, sorted(set(contents) - set(back)))),
             "back to the original, as the patch no longer changes them: %s; "
             % ", ".join(map(shown, back)) if back else "", tool_at(state)))
    return 0


def cmd_verify_native(args: argparse.Namespace) -> int:
    state = open_state(args)
    require_overlay(args, state, "verify-native")
    journal = state.load()
    checked = 0
    problems = []
    named = []  # what a JIT built into a cache, which no --artifact named
    # An artifact is judged by the latest entry that rebuilt it: a later build
    # of a shared library legitimately changes what an earlier one produced.
    seen = set()
    for entry in reversed(journal["entries"]):
        # --no-build: the build runs later (a JIT at import), or has not yet
        later = entry["build"] is None and entry["state"] == NativeEntry.APPLIED
        if entry["state"] != NativeEntry.BUILT and not later:
            here = tool_at(state)
            if entry["state"] in (NativeEntry.BUILD_FAILED, NativeEntry.BUILT_NOTHING):
                problems.append("entry %d is %s, not built: fix the patch or the source, then run "
                                "`%s update`, or run `%s revert`"
                                % (entry["id"], entry["state"], here, here))
            elif entry["build"] is not None:
                problems.append("entry %d is %s, not built: run `%s revert` and apply again"
                                % (entry["id"], entry["state"], here))
            continue
        for cache in entry["caches"] if later and not entry["artifacts"] else []:
            # Set aside at the apply: whatever library it holds now was built since.
            built = sorted(path for path, info in scan_tree(cache["path"], [])[0].items()
                           if info[0] == "f" and LOADABLE_RE.search(os.path.basename(path)))
            if not built:
                problems.append("nothing was built into --invalidate-cache %s since the apply: "
                                "the build that fills it (a JIT at import) has not run yet, or "
                                "did not see the patch" % cache["path"])
            checked += len(built)
            named += ["%s (built into --invalidate-cache %s since the apply)" % (path, cache["path"])
                      for path in built]
        for record in entry["artifacts"]:
            if record["path"] in seen:
                continue
            seen.add(record["path"])
            checked += 1
            if "after_build_identity" in record and content_identity(
                    record["path"]) == record["after_build_identity"]:
                current = record["after_build_sha256"]  # not written since that hash
            else:
                current = content_sha256(record["path"])
            if current is None:
                problems.append("artifact %s is missing%s"
                                % (record["path"], "" if later else " after the build"))
            elif current == record.get("sha256") and later:
                problems.append("artifact %s is unchanged since the apply: the build that "
                                "rebuilds it (a JIT at import) has not run yet, or did not "
                                "see the patch" % record["path"])
            elif current == record.get("sha256"):
                problems.append("artifact %s is unchanged by the build (a silent no-op build?): "
                                "check the build command and the --invalidate-cache directories"
                                % record["path"])
            elif current != record.get("built_sha256") and not later:
                problems.append("artifact %s changed after the build finished" % record["path"])
    for problem in problems:
        print("overlay_setup: E403 %s" % problem, file=sys.stderr)
    if problems:
        return 1
    if checked == 0:
        print("overlay_setup: E405 no built artifact to verify; pass --artifact to add-native or "
              "apply", file=sys.stderr)
        return 1
    print("%d artifact(s) rebuilt from the patched sources%s"
          % (checked, ": " + ", ".join(named) if named else ""))
    return 0


def cmd_status(args: argparse.Namespace) -> int:
    state = open_state(args)
    journal = state.load() if state.exists() or state.orphaned_backups() else None
    others = others_applied(args, state)
    if args.format == "json":
        print(json.dumps({"state": state.root, "journal": journal,
                          "owner": journal and journal["owner"] and dict(
                              journal["owner"], liveness=owner_liveness(journal["owner"])),
                          "applied_elsewhere": [other.root for other, _ in others]},
                         indent=1, sort_keys=True))
        return 0
    if journal is None and os.path.isfile(registry_record(state.root)):
        raise vanished_state(state)
    if journal is None:
        print("no overlay at %s" % state.root)
        if others:
            print("applied overlays of this user:")
            for other, other_journal in others:
                print("  %s: %s" % (other.root, summarise(other, other_journal)))
            print("next: %s, or `overlay_setup.py revert --all`"
                  % " or ".join("`%s status`" % tool_at(other) for other, _ in others))
        return 0
    print("state: %s" % state.root)
    print("owner: %s" % describe_owner(journal["owner"]))
    tool_running = state.lock_held()  # read-only: status takes no lock
    print("tool: %s" % (state.holder() if tool_running else "none running"))
    for name, module in sorted(journal["python"]["modules"].items()):
        print("python: %s <- %s" % (name, module["origin"] if module["file"] else "(deleted)"))
    for target, replacement in sorted(journal["python"]["rebinds"].items()):
        print("rebind: %s -> %s" % (target, replacement))
    for entry in native_entries(state, journal):
        print("\n".join(entry.status_lines(tool_running)))
    print("next: %s" % next_step(state, journal, tool_running))
    return 0


def next_step(state: State, journal: dict, tool_running: bool) -> str:
    here = tool_at(state)
    states = {entry["state"] for entry in journal["entries"]}
    if tool_running:
        return "wait for the running command to finish, then `%s status`" % here
    if not anything_applied(journal):
        return "nothing applied; nothing to do"
    if journal.get("reverting"):
        return "a revert stopped halfway: `%s revert` finishes it" % here
    if NativeEntry.APPLYING in states:
        return ("`%s revert` (it stops a build left running and restores everything)" % here)
    if states & {NativeEntry.BUILD_FAILED, NativeEntry.BUILT_NOTHING}:
        return "fix the patch or the source, then `%s update`, or `%s revert`" % (here, here)
    if NativeEntry.BUILT in states:
        return "`%s verify-native`, measure, then `%s revert`" % (here, here)
    if journal["entries"]:
        return "build, measure, then `%s revert`" % here
    return "run with `eval \"$(%s env)\"`, then `%s revert`" % (here, here)


def state_given(args: argparse.Namespace) -> bool:
    return bool(args.state or os.environ.get("OVERLAY_STATE"))


def others_applied(args: argparse.Namespace, state: State) -> List[Tuple[State, Optional[dict]]]:
    """Without --state and without an overlay here (none, or one reverted):
    this user's applied overlays."""
    if state_given(args) or holds_something(state):
        return []
    return applied_states(skip=state.root)


def commands_for(others: List[Tuple[State, Optional[dict]]], command: str) -> str:
    """The exact commands that run `command` on each of `others`."""
    exact = ["`%s %s`" % (tool_at(other), command) for other, _ in others]
    if len(exact) == 1:
        return exact[0]
    return "%s, or `overlay_setup.py %s --all`" % (" or ".join(exact), command) \
        if command == "revert" else " or ".join(exact)


def require_overlay(args: argparse.Namespace, state: State, command: str) -> None:
    """An overlay command run where there is none: E208 names the exact
    commands for this user's applied overlays, E207 says there are none."""
    if state.orphaned_backups() or (state.exists() and anything_applied(state.load())):
        return
    if not state.exists() and os.path.isfile(registry_record(state.root)):
        raise vanished_state(state)
    others = others_applied(args, state)
    if others:
        raise OverlayError("E208", "no overlay at %s, but this user has applied overlays at %s; "
                           "run %s" % (state.root, ", ".join(other.root for other, _ in others),
                                       commands_for(others, command)))
    if state.exists():  # a state directory stays after its revert: its overlay is gone all the same
        raise OverlayError("E207", "nothing is applied at %s; `apply` or `add-native` first"
                           % state.root)
    raise OverlayError("E207", "no overlay at %s; `apply` or `add-native` first" % state.root)


def summarise(state: State, journal: Optional[dict]) -> str:
    if journal is None:
        return "its journal %s" % ("cannot be read" if state.exists() else "is gone")
    python = journal["python"]
    return "%d native entr%s, %d Python module(s), %d rebind(s); owner %s" % (
        len(journal["entries"]), "y" if len(journal["entries"]) == 1 else "ies",
        len(python["modules"]), len(python["rebinds"]), describe_owner(journal["owner"]))


def revert_state(state: State, force: bool, keep_untracked: bool) -> Tuple[List[str], List[str]]:
    """Revert one state directory under its lock; it leaves the registry once
    nothing is applied.  Returns what was done and the files not back
    byte-exact."""
    with Locked(state, "revert", create=False) as journal:
        if not anything_applied(journal):
            orphans = remove_orphaned_backups(state, journal)
            if orphans:
                print("removed the backups of entr%s %s, left by a revert that was interrupted "
                      "after it had restored them" % ("y" if len(orphans) == 1 else "ies",
                                                      ", ".join(orphans)))
            unregister(state)
            return [], []
        try:
            done, inexact = revert_all(state, journal, force, keep_untracked)
        except OSError as exc:
            raise OverlayError("E601", "%s (%s) while reverting; the journal keeps what is left: "
                               "fix the cause and run `%s revert` again"
                               % (io_failure(exc), exc.strerror, tool_at(state)))
        unregister(state)
    return done, inexact


def cmd_revert(args: argparse.Namespace) -> int:
    if args.all:
        if state_given(args):
            raise UsageError("E109", "--all reverts every applied overlay of this user; drop "
                             "--state (or $OVERLAY_STATE), or drop --all")
        return revert_every_state(args)
    state = open_state(args)
    if not holds_something(state):
        try:
            require_overlay(args, state, "revert")
        except OverlayError as exc:
            if exc.code != "E207":  # E208 and E209: it may be elsewhere, or lost
                raise
        if not state.exists():
            print("nothing to revert: no overlay at %s" % state.root)
            return 0
    done, inexact = revert_state(state, args.force, args.keep_untracked)
    if not done:
        print("nothing to revert at %s" % state.root)
        return 0
    for line in done:
        print(line)
    print("reverted %s" % state.root)
    if inexact:
        report_inexact(state, inexact)
        return NOT_EXACT
    return 0


def revert_every_state(args: argparse.Namespace) -> int:
    failures = 0
    not_exact = False
    roots = registered_states()
    for root in roots:
        state = State(root)
        try:
            state.check_safe()
            if not (state.exists() or state.orphaned_backups()):
                raise vanished_state(state)
            done, inexact = revert_state(state, args.force, args.keep_untracked)
        except OverlayError as exc:
            failures += 1
            print("overlay_setup: %s %s" % (exc.code, exc.message), file=sys.stderr)
            continue
        for line in done:
            print(line)
        if done:
            print("reverted %s" % root)
        if inexact:
            report_inexact(state, inexact)
            not_exact = True
    if failures:
        print("overlay_setup: %d state director%s not reverted; see above"
              % (failures, "y" if failures == 1 else "ies"), file=sys.stderr)
        return 1
    if not roots:
        print("nothing to revert: no applied overlay in %s" % state_home())
    return NOT_EXACT if not_exact else 0


def find_state_dirs(root: str) -> List[str]:
    found = []
    for directory, dirs, files in os.walk(root):
        if (JOURNAL_NAME in files or OLD_JOURNAL_NAME in files) and "lock" in files:
            found.append(directory)
            dirs[:] = []
            continue
        dirs[:] = sorted(name for name in dirs
                         if not os.path.islink(os.path.join(directory, name)))
    return sorted(found)


def prune(state: State) -> None:
    """Remove a state directory of the state home that holds nothing, its
    lock held: renamed aside first, so that its name is either the whole
    directory or free.  A command that was waiting for its lock then finds
    no journal to write and stops with a message, before any change."""
    aside = os.path.join(state_home(), ".pruned-%s-%d" % (os.path.basename(state.root), os.getpid()))
    os.rename(state.root, aside)
    shutil.rmtree(aside)


def cmd_gc_stale(args: argparse.Namespace) -> int:
    root = os.path.abspath(args.root or os.getcwd())
    if not os.path.isdir(root):
        raise UsageError("E107", "--root %s is not a directory; pass the directory to search"
                         % root)
    failures = pruned = 0
    not_exact = False
    registered = []
    for directory in registered_states():
        if State(directory).exists() or State(directory).orphaned_backups():
            registered.append(directory)
        else:
            failures += 1
            vanished = vanished_state(State(directory))
            print("overlay_setup: %s %s" % (vanished.code, vanished.message), file=sys.stderr)
    # The state home's directories that hold nothing any more are pruned below, wherever root is.
    try:
        names = os.listdir(state_home())
    except OSError:
        names = []
    reverted = [path for path in (os.path.join(state_home(), name) for name in names)
                if not os.path.islink(path) and State(path).exists()]
    directories = sorted(set(find_state_dirs(root) + registered + reverted))
    reported = False  # a line said what became of a state directory
    for directory in directories:
        state = State(directory)
        try:
            state.check_safe()
            if not state.try_lock("gc-stale"):
                print("live: %s (locked by %s)" % (directory, state.holder()))
                reported = True
                continue
            try:
                journal = state.load()
                liveness = owner_liveness(journal["owner"])
                if not anything_applied(journal):
                    if not args.dry_run:
                        remove_orphaned_backups(state, journal)
                        unregister(state)
                        leftovers = os.path.join(directory, "leftovers")
                        if in_state_home(directory) and os.path.isdir(leftovers) and \
                                os.listdir(leftovers):
                            print("kept %s: its leftovers folder holds files moved aside when a "
                                  "killed build was reverted (a build's products, or your own "
                                  "edits); look at them, then remove the directory" % directory)
                            reported = True
                        elif in_state_home(directory):
                            prune(state)
                            pruned += 1
                    continue
                # The owner's liveness decides for a completed overlay only.
                crashed = interrupted(state, journal)
                if liveness != "gone" and crashed is None:
                    print("live: %s (owner %s)" % (directory, describe_owner(journal["owner"])))
                    reported = True
                    continue
                why = "owner %s%s" % (describe_owner(journal["owner"]), "" if liveness == "gone"
                                      else "; the run %s stopped halfway" % crashed)
                reported = True
                if args.dry_run:
                    print("stale: %s (%s): would revert" % (directory, why))
                    continue
                _, inexact = revert_all(state, journal, force=False, keep_untracked=False)
                unregister(state)
                print("stale: %s (%s): reverted" % (directory, why))
                if inexact:
                    report_inexact(state, inexact)
                    not_exact = True
            finally:
                state.unlock()
        except OverlayError as exc:
            failures += 1
            print("overlay_setup: %s %s" % (exc.code, exc.message), file=sys.stderr)
        except OSError as exc:
            failures += 1
            print("overlay_setup: E601 %s: %s (%s); run `overlay_setup.py gc-stale` again once "
                  "the cause is fixed" % (directory, io_failure(exc), exc.strerror),
                  file=sys.stderr)
    if pruned:
        print("removed %d state director%s with nothing applied from %s"
              % (pruned, "y" if pruned == 1 else "ies", state_home()))
    if not reported and not failures:
        # Silence would not tell "nothing stale" from "looked nowhere".
        print("nothing stale: %d state director%s with nothing applied under %s or in the "
              "registry" % (len(directories), "y" if len(directories) == 1 else "ies", root)
              if directories else "nothing stale: no state directory under %s or in the registry"
              % root)
    if failures:
        print("overlay_setup: %d state director%s refused or failed; see above"
              % (failures, "y" if failures == 1 else "ies"), file=sys.stderr)
        return 1
    return NOT_EXACT if not_exact else 0


# ---------------------------------------------------------------- trial

TRIAL_EXIT = {"reference": 10, "apply": 11, "verify": 12, "candidate": 13, "revert": 14}


def trial_watched(root: str, build_cwd: str, trees: List[str],
                  artifacts: List[str], kept: List[str]) -> List[str]:
    """What a trial compares before and after, everything the overlay is
    responsible for: --root, --build-cwd, the directories the build writes
    in (its installed distributions' folders among them), the caches and
    --protect paths (`kept`), and each --artifact outside them (its folder
    when that holds a build.ninja: a JIT's build directory, which the build
    rewrites around it)."""
    watched = {root, build_cwd} | set(trees) | set(kept)
    for artifact in artifacts:
        if not any(is_within(artifact, path) for path in watched):
            folder = os.path.dirname(artifact)
            watched.add(folder if os.path.isfile(os.path.join(folder, "build.ninja"))
                        else artifact)
    return sorted(path for path in watched
                  if not any(path != other and is_within(path, other) for other in watched))


def install_fingerprint(roots: List[str], excluded: List[str]) -> Dict[str, tuple]:
    """Every file, link and directory under `roots` (directories, or single
    files) by kind, mode, size, mtime and content, to prove a revert gave the
    install back.  A directory's size is left out: on tmpfs, btrfs and xfs it
    counts the entries, which are listed themselves."""
    found: Dict[str, tuple] = {}
    for root in roots:
        if any(is_within(root, path) for path in excluded) or not os.path.lexists(root):
            continue
        st = os.lstat(root)
        for path, st in [(root, st)] + (list(walk_tree(root, excluded))
                                        if stat.S_ISDIR(st.st_mode) else []):
            if path not in found:
                folder = stat.S_ISDIR(st.st_mode)
                found[path] = (stat.S_IFMT(st.st_mode), stat.S_IMODE(st.st_mode),
                               None if folder else st.st_size, st.st_mtime_ns,
                               None if folder else file_sha256(path))
    return found


def overlay_environment(state: State) -> Dict[str, str]:
    """PYTHONPATH and OVERLAY_STATE of the Python overlay, as `env` prints them."""
    existing = os.environ.get("PYTHONPATH", "")
    entries = [state.site] + [entry for entry in existing.split(os.pathsep)
                              if entry and entry != state.site]
    return {"PYTHONPATH": os.pathsep.join(entries), "OVERLAY_STATE": state.root}


def run_measured(command: List[str], env: Optional[Dict[str, str]] = None
                 ) -> Tuple[int, float, bytes]:
    """Run the caller's command with our stdin and stderr, its output shown
    on our stderr (stdout carries the summary) and kept to compare the two
    sides; (exit status, seconds, output)."""
    start = time.monotonic()
    process = subprocess.Popen(command, stdout=subprocess.PIPE,
                               env=None if env is None else dict(os.environ, **env))
    shown = getattr(sys.stderr, "buffer", None)
    output = []
    try:
        for chunk in iter(lambda: process.stdout.read1(65536), b""):
            output.append(chunk)
            if shown is None:
                sys.stderr.write(chunk.decode("utf-8", "replace"))
            else:
                shown.write(chunk)
                shown.flush()
        status = process.wait()
    except BaseException:
        process.kill()
        process.wait()
        raise
    finally:
        process.stdout.close()
    return (status if status >= 0 else 128 - status), time.monotonic() - start, b"".join(output)


def applied_in_words(journal: dict) -> str:
    """What a state directory holds, each entry with its sources, and whose."""
    parts = ["entry %d (%s)" % (entry["id"], ", ".join(record["path"]
                                                       for record in entry["sources"]))
             for entry in journal["entries"]]
    parts += ["Python module %s" % name for name in sorted(journal["python"]["modules"])]
    parts += ["a rebind of %s" % name for name in sorted(journal["python"]["rebinds"])]
    return "%s, owner %s" % (", ".join(parts), describe_owner(journal["owner"]))


def cmd_trial(args: argparse.Namespace) -> int:
    command = getattr(args, "trial_command", None)
    if not command:
        raise UsageError("E100", "pass the command to measure after --, e.g. `trial fix.diff "
                         "--build-cmd make -- python3 bench.py`")
    if args.dry_run:
        raise UsageError("E100", "trial runs the patch; see its plan with `apply --dry-run`")
    if args.repeat < 1:
        raise UsageError("E109", "--repeat must be 1 or more")
    if shutil.which(command[0]) is None:  # refused before the install is touched
        raise UsageError("E102", "cannot run %s: no such command on PATH, or not an executable "
                         "file; pass the command to measure as it runs from here" % command[0])
    if args.owner_pid is None:
        args.owner_pid = os.getpid()  # a trial killed outright is gone: gc-stale reverts it
    owner = make_owner(args.owner_pid)
    args.in_trial = True  # apply leaves out its advice to revert: the trial does that
    state = open_state(args)
    journal = state.load() if state.exists() else None
    if journal is not None and anything_applied(journal):
        raise OverlayError("E103", "a trial needs a state directory with nothing applied, and "
                           "%s holds %s; run `%s revert`, or pass another --state"
                           % (state.root, applied_in_words(journal), tool_at(state)))
    root = require_abs_normal(args.root or os.getcwd(), "--root")
    build_cwd = require_abs_normal(args.build_cwd or (os.getcwd() if args.build_cmd else root),
                                   "--build-cwd")
    artifacts, caches, protected = ([os.path.normpath(os.path.abspath(path)) for path in paths]
                                    for paths in (args.artifact, args.invalidate_cache, args.protect))
    trees = build_trees_of(args, build_cwd, artifact_distributions(artifacts, caches), artifacts,
                           caches) if args.build_cmd else []
    watched = trial_watched(root, build_cwd, trees, artifacts, caches + protected)
    excluded = [state.root, registry_dir()]
    result = {"patch": os.path.abspath(args.patch), "state": state.root, "command": command,
              "watched": watched, "runs": [], "verify": None, "revert": None,
              "failed_step": None}
    outputs: List[Tuple[bytes, bytes]] = []

    def stop(signum: int, frame: object) -> None:
        raise Stopped(signum)

    previous = {signum: signal.signal(signum, stop) for signum in (signal.SIGTERM, signal.SIGHUP)}
    status = 0
    try:
        for round_number in range(1, args.repeat + 1):
            status = trial_round(args, state, owner, command, watched, excluded, result,
                                 round_number, outputs)
            if status:
                break
    except KeyboardInterrupt:
        result["failed_step"], status = "interrupted by SIGINT", 130
    except Stopped as exc:
        result["failed_step"] = "interrupted by %s" % signal.Signals(exc.signum).name
        status = 128 + exc.signum
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
    revert = result["revert"]
    # 130 and 143 say the install is back: only when it is byte-identical
    if revert is not None and not revert["reverted"]:
        status = TRIAL_EXIT["revert"]
        result["failed_step"] = "revert: the revert did not finish (see above)"
    elif revert is not None and revert["differences"]:
        status = TRIAL_EXIT["revert"]
        result["failed_step"] = "revert: the install is not as it was before"
    result["exit"] = status
    result["summary"] = trial_summary(result["runs"])
    result["output"] = compare_outputs(outputs)
    report_trial(result, args.format)
    return status


def trial_round(args: argparse.Namespace, state: State, owner: dict, command: List[str],
                watched: List[str], excluded: List[str], result: dict, round_number: int,
                outputs: List[Tuple[bytes, bytes]]) -> int:
    """One reference run, apply and build, verification, one candidate run
    (with the overlay's PYTHONPATH, so that a .py patch is in effect) and the
    revert, which runs whatever happened before it.  With --no-build the
    verification follows the candidate run, where a JIT at import builds."""
    kept = {}

    def run(kind: str, env: Optional[Dict[str, str]] = None) -> int:
        print("trial: %s run %d: %s" % (kind, round_number, " ".join(map(shell_quote, command))),
              file=sys.stderr, flush=True)
        status, seconds, kept[kind] = run_measured(command, env)
        result["runs"].append({"kind": kind, "round": round_number, "exit": status,
                               "seconds": round(seconds, 6)})
        return status

    def failed(step: str, why: str) -> int:
        result["failed_step"] = "%s: %s" % (step, why)
        return TRIAL_EXIT[step]

    def verify() -> bool:
        if not args.artifact:
            result["verify"] = "skipped: no --artifact"
            return True
        with contextlib.redirect_stdout(sys.stderr):
            if cmd_verify_native(args):
                return False
        result["verify"] = "%d artifact(s) rebuilt%s" % (len(args.artifact), (
            " (checked after the candidate run: with --no-build the build runs in it)"
            if args.no_build else ""))
        return True

    if run("reference"):
        return failed("reference", "the command failed on the clean install")
    before = install_fingerprint(watched, excluded)
    status = 0
    try:
        with contextlib.redirect_stdout(sys.stderr):  # stdout carries the summary
            try:
                cmd_apply(args)
            except OverlayError as exc:
                print("overlay_setup: %s %s" % (exc.code, trial_advice(exc.message)),
                      file=sys.stderr)
                return failed("apply", "%s (see above)" % exc.code)
        if not args.no_build and not verify():
            return failed("verify", "an artifact is not rebuilt (see above)")
        python = state.load()["python"]
        marker = os.path.join(state.root, "loaded")  # a line for each process it served
        remove_file(marker)
        if run("candidate", dict(overlay_environment(state), OVERLAY_LOADED=marker)):
            status = failed("candidate", "the command failed on the patched install")
        elif (python["modules"] or python["rebinds"]) and not (
                os.path.isfile(marker) and os.path.getsize(marker)):
            status = failed("candidate", "no process of the candidate run loaded the Python "
                            "overlay (python -I, -E or -S ignores its PYTHONPATH or "
                            "sitecustomize), so the patched module was not in effect")
        elif args.no_build and not verify():
            status = failed("verify", "an artifact is not rebuilt by the candidate run (see "
                                      "above)")
        if kept.get("reference") and kept.get("candidate"):
            outputs.append((kept["reference"], kept["candidate"]))
    finally:
        signum = revert_trial(state, owner, watched, excluded, before, result)
        if signum is not None:
            raise Stopped(signum)
    if not result["revert"]["reverted"] or result["revert"]["differences"]:
        return failed("revert", "the install is not as it was before")
    return status


def trial_advice(message: str) -> str:
    """A message of the trial's apply without its advice to run revert: the
    trial reverts by itself."""
    return "; ".join(part for part in message.split("; ") if "revert" not in part)


def revert_trial(state: State, owner: dict, watched: List[str], excluded: List[str],
                 before: dict, result: dict) -> Optional[int]:
    """Revert what this trial applied, and only that: an overlay another
    owner applied in the same state directory (a second worker) is left
    alone.  A first SIGINT, SIGTERM or SIGHUP lets the revert finish (and is
    returned, to stop the trial after it); a second one stops it."""
    received: List[int] = []

    def later(signum: int, frame: object) -> None:
        if received:
            raise Stopped(signum)
        received.append(signum)
        print("trial: %s during the revert; finishing the revert first (a second signal stops "
              "it and leaves the install patched)" % signal.Signals(signum).name,
              file=sys.stderr, flush=True)

    signals = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
    previous = {signum: signal.signal(signum, later) for signum in signals}
    reverted, left_alone, stopped_by = True, None, None
    try:
        with contextlib.redirect_stdout(sys.stderr):
            journal = state.load() if state.exists() else None
            if journal is not None and anything_applied(journal) and \
                    not same_process(journal.get("owner") or {}, owner):  # not the trial's
                left_alone = "the overlay at %s is another's: %s; the trial applied nothing " \
                             "there and left it alone" % (state.root,
                                                          applied_in_words(journal))
            elif journal is not None:
                revert_state(state, False, False)
    except OverlayError as exc:
        print("overlay_setup: %s %s" % (exc.code, exc.message), file=sys.stderr)
        reverted = False
    except Stopped as exc:
        reverted, stopped_by = False, signal.Signals(exc.signum).name
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
    if left_alone is not None:
        result["revert"] = {"reverted": True, "differences": [], "left_alone": left_alone}
        return received[0] if received else None
    after = install_fingerprint(watched, excluded)
    differences = sorted(path for path in set(before) | set(after)
                         if before.get(path) != after.get(path))
    if stopped_by is not None:
        print("overlay_setup: the trial's revert was stopped by a second %s; %s: run `%s revert` "
              "to finish it" % (stopped_by, "the install is still patched" if differences else
                                "the journal still lists the overlay", tool_at(state)),
              file=sys.stderr)
    result["revert"] = {"reverted": reverted, "differences": differences, "left_alone": None}
    return received[0] if received else None


def median(values: List[float]) -> float:
    ordered = sorted(values)
    middle = len(ordered) // 2
    return ordered[middle] if len(ordered) % 2 else (ordered[middle - 1] + ordered[middle]) / 2


def time_spread(seconds: List[float]) -> Optional[dict]:
    if not seconds:
        return None
    return {"runs": len(seconds), "min": round(min(seconds), 6),
            "median": round(median(seconds), 6), "max": round(max(seconds), 6)}


def trial_summary(runs: List[dict]) -> dict:
    """Per side the min, median and max wall time; the candidate / reference
    ratio of the medians, with its range over the rounds that ran both sides."""
    sides = {kind: [run["seconds"] for run in runs if run["kind"] == kind]
             for kind in ("reference", "candidate")}
    rounds = {}
    for run in runs:
        rounds.setdefault(run["round"], {})[run["kind"]] = run["seconds"]
    ratios = [pair["candidate"] / pair["reference"] for pair in rounds.values()
              if len(pair) == 2 and pair["reference"] > 0]
    summary = {kind: time_spread(seconds) for kind, seconds in sides.items()}
    summary["ratio"] = None
    if ratios and summary["reference"]["median"] > 0:
        summary["ratio"] = {"median": round(summary["candidate"]["median"]
                                            / summary["reference"]["median"], 3),
                            "min": round(min(ratios), 3), "max": round(max(ratios), 3),
                            "pairs": len(ratios)}
    return summary


def compare_outputs(outputs: List[Tuple[bytes, bytes]]) -> Optional[dict]:
    """Whether the candidate printed what the reference printed, over the
    rounds where both printed something; the first differing line if not."""
    if not outputs:
        return None
    for number, (reference, candidate) in enumerate(outputs, 1):
        if reference == candidate:
            continue
        ours = reference.decode("utf-8", "replace").splitlines()
        theirs = candidate.decode("utf-8", "replace").splitlines()
        line = next((i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b),
                    min(len(ours), len(theirs)))
        return {"rounds": len(outputs), "differs": True, "round": number, "line": line + 1,
                "reference": ours[line] if line < len(ours) else None,
                "candidate": theirs[line] if line < len(theirs) else None}
    return {"rounds": len(outputs), "differs": False, "round": None, "line": None,
            "reference": None, "candidate": None}


def report_trial(result: dict, output_format: Optional[str]) -> None:
    if output_format == "json":
        print(json.dumps(result, indent=1, sort_keys=True))
        return
    print("trial of %s (state %s):" % (result["patch"], result["state"]))
    print("  watched: %s (writes elsewhere, such as an install prefix, are not checked)"
          % ", ".join(result["watched"]))
    for run in result["runs"]:
        print("  %s run %d: exit %d in %.2fs" % (run["kind"], run["round"], run["exit"],
                                                 run["seconds"]))
    summary = result["summary"]
    if max(len([run for run in result["runs"] if run["kind"] == kind])
           for kind in ("reference", "candidate")) > 1:
        for kind in ("reference", "candidate"):
            spread = summary[kind]
            if spread is not None:
                print("  %s: median %.3fs, min %.3fs, max %.3fs (%d runs)"
                      % (kind, spread["median"], spread["min"], spread["max"], spread["runs"]))
    ratio = summary["ratio"]
    if ratio is not None and ratio["pairs"] > 1:
        print("  candidate/reference: %.3f (ratio of the medians; %.3f to %.3f over the %d "
              "paired runs)" % (ratio["median"], ratio["min"], ratio["max"], ratio["pairs"]))
    output = result["output"]
    if output is not None and output["differs"]:
        print("  output: differs (round %d, line %d): reference %s, candidate %s"
              % (output["round"], output["line"], json.dumps(output["reference"]),
                 json.dumps(output["candidate"])))
    elif output is not None:
        print("  output: the same on both sides")
    if result["verify"] is not None:
        print("  verify: %s" % result["verify"])
    revert = result["revert"]
    if revert is not None and revert["left_alone"]:
        print("  revert: nothing of the trial's to revert: %s" % revert["left_alone"])
    elif revert is not None:
        print("  revert: %s" % (
            "the install is byte-identical to before" if revert["reverted"]
            and not revert["differences"] else "the install differs from before: %s" % (
                ", ".join(revert["differences"][:10]) or "the revert failed (see above)")))
    print("result: %s (exit status %d)" % (result["failed_step"] or "ok", result["exit"]))


# ---------------------------------------------------------------- CLI

EPILOG = """examples:
  overlay_setup.py add-native --source /opt/pkg/csrc/gemm.cu --patched gemm_fast.cu \\
      --artifact /opt/pkg/build/gemm.o --artifact /opt/pkg/lib/libpkg.so \\
      --build-cmd 'make -C /opt/pkg -j2' --build-cwd /opt/pkg
  overlay_setup.py verify-native && run-benchmark && overlay_setup.py revert
  overlay_setup.py apply fix.diff --root /opt/pkg -p1 --artifact /opt/pkg/lib/libpkg.so \\
      --build-cmd 'make -j2' --build-cwd /opt/pkg
  eval "$(overlay_setup.py env)"; python3 -c 'import pkg.mod'
  overlay_setup.py gc-stale --root /work --dry-run
"""


COMMAND_EXAMPLES = {
    "init": "overlay_setup.py --state /tmp/try-gemm init --owner-pid $$",
    "add-python": "overlay_setup.py add-python vllm.model_executor.layers.layernorm "
                  "./layernorm_fast.py",
    "rebind": "overlay_setup.py rebind vllm._custom_ops:rms_norm myops.fast:rms_norm",
    "env": 'eval "$(overlay_setup.py env)"; python3 -m vllm.entrypoints.openai.api_server ...',
    "add-native": "overlay_setup.py add-native --source /opt/pkg/csrc/gemm.cu "
                  "--patched gemm_fast.cu \\\n"
                  "      --artifact /opt/pkg/lib/libpkg.so --invalidate-cache /opt/pkg/build/gemm \\\n"
                  "      --build-cmd 'make -C /opt/pkg -j2' --build-cwd /opt/pkg",
    "apply": "overlay_setup.py apply fix.diff --root /opt/pkg -p1 "
             "--artifact /opt/pkg/lib/libpkg.so \\\n"
             "      --build-cmd 'make -j2' --build-cwd /opt/pkg",
    "update": "overlay_setup.py update --patched gemm_faster.cu   # apply once, update many, "
              "revert once",
    "trial": "overlay_setup.py trial fix.diff --root /opt/pkg --artifact /opt/pkg/lib/libpkg.so "
             "\\\n      --build-cmd 'make -j2' --build-cwd /opt/pkg -- python3 bench.py",
    "verify-native": "overlay_setup.py verify-native && run-benchmark && overlay_setup.py revert",
    "status": "overlay_setup.py status --json",
    "revert": "overlay_setup.py --state /tmp/try-gemm revert",
    "gc-stale": "overlay_setup.py gc-stale --root /work --dry-run",
}


class CommandLineError(UsageError):
    """A command line argparse cannot read; main() adds where the usage is."""


class Parser(argparse.ArgumentParser):
    # What the usage line says beyond argparse's: trial's command after `--`
    # (main() cuts it off before parsing), and that one of --build-cmd and
    # --no-build is required except with --dry-run, which argparse cannot
    # express.  Made when shown, not for every command on every run.
    usage_tail = ""

    def error(self, message: str) -> None:  # type: ignore[override]
        raise CommandLineError("E100", message)  # one line, not argparse's usage dump

    def format_usage(self) -> str:
        return self._shown(super().format_usage())

    def format_help(self) -> str:
        return self._shown(super().format_help())

    def _shown(self, text: str) -> str:
        usage, blank, rest = text.partition("\n\n")
        usage = usage.rstrip("\n").replace("[--build-cmd CMD | --no-build]",
                                           "(--build-cmd CMD | --no-build)") + self.usage_tail
        return usage + ("\n\n" + rest if blank else "\n")


def add_format(parser: argparse.ArgumentParser, help_text: str) -> None:
    """--format, and --json as its alias (both tools take both)."""
    parser.add_argument("--format", choices=("text", "json"), default=None, help=help_text)
    parser.add_argument("--json", action="store_true", help="same as --format json")


def resolve_format(args: argparse.Namespace) -> None:
    if getattr(args, "json", False):
        if args.format not in (None, "json"):
            raise UsageError("E100", "--json and --format %s ask for two formats; give one"
                             % args.format)
        args.format = "json"


class UnnamedCommand:
    """Stands in for the parser of a command the command line does not name
    (build_parser's `only`): what is added to it is dropped."""

    def add_argument(self, *args: object, **kwargs: object) -> None:
        pass

    def add_mutually_exclusive_group(self) -> "UnnamedCommand":
        return self


def build_parser(only: Optional[str] = None) -> argparse.ArgumentParser:
    """The command-line parser; with `only`, one that knows that command alone."""
    state_help = ("state directory (default: $OVERLAY_STATE, else the current directory's own "
                  "under $XDG_STATE_HOME/overlay_setup/)")
    parser = Parser(
        prog="overlay_setup.py", formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Reversible, crash-safe in-place patches of native sources and Python "
                    "overlays in an installed package.", epilog=EPILOG)
    parser.add_argument("--state", metavar="DIR", default=None, help=state_help)
    parser.add_argument("--version", action="version", version="%(prog)s " + VERSION)
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=Parser)
    commands.required = True

    def command(name: str, help_text: str, owner: bool = False) -> argparse.ArgumentParser:
        if only not in (None, name):
            return UnnamedCommand()  # type: ignore[return-value]
        sub = commands.add_parser(name, help=help_text, description=help_text,
                                  epilog="example:\n  " + COMMAND_EXAMPLES[name],
                                  formatter_class=argparse.RawDescriptionHelpFormatter)
        sub.add_argument("--state", metavar="DIR", default=argparse.SUPPRESS, help=state_help)
        if owner:
            sub.add_argument("--owner-pid", type=int, default=None, metavar="PID",
                             help="process owning the overlay (default: the leader of this "
                                  "session, looking through sudo and setsid)")
        return sub

    def patch_options(sub: argparse.ArgumentParser, python: bool) -> None:
        sub.add_argument("--root", metavar="DIR", help="directory the patch paths are relative "
                                                       "to (default: the current directory)")
        sub.add_argument("-p", type=int, default=1, metavar="N",
                         help="strip N leading path components (default: 1, as for git diffs)")
        if python:
            sub.add_argument("--python", metavar="PATH", default=sys.executable,
                             help="the interpreter that runs the install, asked under which "
                                  "module name it imports each .py file of the patch "
                                  "(default: the one running this tool)")

    def native(sub: argparse.ArgumentParser) -> None:
        sub.add_argument("--artifact", action="append", default=[], metavar="PATH",
                         help="a build output to back up and check (repeatable)")
        sub.add_argument("--invalidate-cache", action="append", default=[], metavar="DIR",
                         help="a build cache directory set aside for the build (repeatable)")
        build = sub.add_mutually_exclusive_group()
        build.add_argument("--build-cmd", metavar="CMD",
                           help="the install's own build command, run through the shell (this or "
                                "--no-build is required, except with --dry-run)")
        build.add_argument("--no-build", action="store_true", help="patch without building")
        sub.add_argument("--build-cwd", metavar="DIR",
                         help="directory the build runs in (default: the current directory)")
        sub.add_argument("--build-dir", action="append", default=[], metavar="DIR",
                         help="a directory the build writes in, where the tool cannot tell "
                              "them from the command (repeatable; default: read from it)")
        sub.add_argument("--timeout", type=float, metavar="S",
                         help="kill the build after S seconds (default: no limit)")
        sub.add_argument("--protect", action="append", default=[], metavar="PATH",
                         help="also back up this file, or every file in this directory, so "
                              "revert gives it back byte-exact (repeatable)")
        sub.add_argument("--no-protect", action="store_true",
                         help="do not back up the build products the build may rewrite "
                              "(make -n / ninja's graph / the build directory); revert then "
                              "leaves them to be rebuilt")
        sub.add_argument("--dry-run", action="store_true",
                         help="change nothing; print what would be backed up and built, and "
                              "the build systems found near the source when --build-cmd is "
                              "not given")

    command("init", "create the state directory (idempotent)", owner=True)
    sub = command("add-python", "serve FILE as module MODULE to processes using `env`", owner=True)
    sub.add_argument("module", metavar="MODULE", help="dotted module name, e.g. pkg.ops")
    sub.add_argument("file", metavar="FILE", help="the Python file to serve as MODULE")
    sub = command("rebind", "replace pkg.mod:attr by other.mod:attr on import", owner=True)
    sub.add_argument("target", metavar="TARGET", help="pkg.mod:attr to replace")
    sub.add_argument("replacement", metavar="REPLACEMENT", help="other.mod:attr to put in its place")
    sub = command("env", "print the environment that activates the Python overlay")
    add_format(sub, "text: shell export lines; json: one object (default: text)")
    sub = command("add-native", "patch one compiled source in place and rebuild", owner=True)
    sub.add_argument("--source", required=True, metavar="PATH", help="installed file to patch")
    sub.add_argument("--patched", required=True, metavar="FILE", help="its patched content")
    native(sub)
    sub = command("apply", "apply a unified diff: natives in place, .py files as overlay",
                  owner=True)
    sub.add_argument("patch", metavar="PATCH", help="a unified diff (git diff or diff -u)")
    patch_options(sub, python=True)
    native(sub)
    sub = command("update", "give an applied entry new patched content (or keep the sources "
                  "as fixed in place) and build again; the original backups stay", owner=True)
    sub.add_argument("patch", metavar="PATCH", nargs="?",
                     help="a unified diff against the original sources, as for apply "
                          "(default: none; with neither it nor --patched, the sources as they "
                          "are now, fixed in place)")
    sub.add_argument("--patched", metavar="FILE",
                     help="the new content of the entry's one source (default: none)")
    sub.add_argument("--entry", type=int, metavar="N",
                     help="the entry to update (default: the latest)")
    patch_options(sub, python=False)
    sub.add_argument("--timeout", type=float, metavar="S",
                     help="kill the build after S seconds (default: the entry's)")
    sub = command("trial", "A/B: run COMMAND on the clean install, apply PATCH and build, "
                  "run COMMAND again, and always revert", owner=True)
    sub.add_argument("patch", metavar="PATCH", help="a unified diff, as for apply")
    patch_options(sub, python=True)
    native(sub)
    sub.add_argument("--repeat", type=int, default=1, metavar="N",
                     help="rounds of reference run, apply, candidate run, revert (default: 1)")
    add_format(sub, "text: a summary; json: one object (default: text)")
    sub.usage_tail = " -- COMMAND [ARG...]"
    command("verify-native", "check that every tracked artifact was rebuilt")
    sub = command("status", "show what is applied")
    add_format(sub, "text: one line per item; json: the journal as JSON (default: text)")
    sub = command("revert", "take everything back out, byte-exact")
    sub.add_argument("--force", action="store_true",
                     help="restore sources even if someone changed them after the apply")
    sub.add_argument("--keep-untracked", action="store_true",
                     help="keep files the build made that no --artifact/--invalidate-cache covers")
    sub.add_argument("--all", action="store_true",
                     help="revert every applied overlay of this user (from the registry)")
    sub = command("gc-stale", "revert what a killed run left halfway, and overlays whose owner is gone")
    sub.add_argument("--root", metavar="DIR", help="where to look (default: the current directory)")
    sub.add_argument("--dry-run", action="store_true", help="only report what would be reverted")
    return parser


def command_hint(message: str) -> str:
    """'; did you mean "apply"?' for a command argparse does not know."""
    unknown = re.match(r"argument COMMAND: invalid choice: '([^']*)'", message)
    if unknown is None:
        return ""
    import difflib  # only on this path: it costs the start-up of every command
    near = difflib.get_close_matches(unknown.group(1), list(COMMANDS), n=1)
    return '; did you mean "%s"?' % near[0] if near else ""


def named_command(argv: List[str]) -> Optional[str]:
    """The command of a command line that names it first, after any --state
    DIR: a parser that knows that command alone reads such a line as the
    whole parser does.  None for any other line (--help, --version, an
    abbreviated --state, no command or an unknown one)."""
    rest = list(argv)
    while rest:
        if rest[0] == "--state" and len(rest) > 1:
            del rest[:2]
        elif rest[0].startswith("--state="):
            del rest[0]
        else:
            break
    return rest[0] if rest and rest[0] in COMMANDS else None


COMMANDS = {"init": cmd_init, "add-python": cmd_add_python, "rebind": cmd_rebind,
            "env": cmd_env, "add-native": cmd_add_native, "apply": cmd_apply,
            "update": cmd_update, "trial": cmd_trial, "verify-native": cmd_verify_native,
            "status": cmd_status, "revert": cmd_revert, "gc-stale": cmd_gc_stale}


def main(argv: Optional[List[str]] = None) -> int:
    _FAULTS["points"] = _FAULTS["writes"] = 0
    _FAULTS["target"] = None
    for stream in (sys.stdout, sys.stderr):  # a file name that is not UTF-8 is escaped
        if hasattr(stream, "reconfigure"):
            stream.reconfigure(errors="backslashreplace")
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = build_parser(named_command(argv))
    trial_command = None
    if "trial" in argv and "--" in argv[argv.index("trial"):]:
        cut = argv.index("--", argv.index("trial"))  # the command trial measures
        argv, trial_command = argv[:cut], argv[cut + 1:]
    try:
        args = parser.parse_args(argv)
        args.trial_command = trial_command
        resolve_format(args)
    except SystemExit as exc:  # --help, --version
        return int(exc.code or 0)
    except CommandLineError as exc:
        command = next((arg for arg in (sys.argv[1:] if argv is None else argv)
                        if arg in COMMANDS), None)
        print("overlay_setup: E100 %s%s; see overlay_setup.py %s--help"
              % (exc.message, command_hint(exc.message), command + " " if command else ""),
              file=sys.stderr)
        return 2
    except UsageError as exc:
        print("overlay_setup: %s %s" % (exc.code, exc.message), file=sys.stderr)
        return exc.status
    try:
        if signal.getsignal(signal.SIGINT) is _interrupted_at_start_up:
            signal.signal(signal.SIGINT, signal.default_int_handler)
        status = COMMANDS[args.command](args)
        sys.stdout.flush()  # a closed stdout shows here, not at exit
        return status
    except OverlayError as exc:
        print("overlay_setup: %s %s" % (exc.code, exc.message), file=sys.stderr)
        return exc.status
    except OSError as exc:
        if isinstance(exc, BrokenPipeError) and exc.filename is None:
            # Whoever reads our output stopped (`status | head -1`): not a
            # write of the install or the journal, and what was done stays
            # journaled.
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
            return 128 + signal.SIGPIPE
        print("overlay_setup: E601 %s (%s); the journal keeps what is applied: fix the cause, "
              "then run `%s revert`"
              % (io_failure(exc), exc.strerror, tool_at(State(state_root(args)))), file=sys.stderr)
        return 1
    except Stopped as exc:
        print("overlay_setup: stopped by %s; the build was stopped with it and the patch stays "
              "applied: run `%s revert`"
              % (signal.Signals(exc.signum).name, tool_at(State(state_root(args)))),
              file=sys.stderr)
        return 128 + exc.signum
    except RolledBack:
        print("overlay_setup: interrupted; what this run applied is reverted", file=sys.stderr)
        return 130
    except KeyboardInterrupt:
        here = tool_at(State(state_root(args)))
        print("overlay_setup: interrupted; run `%s status`, then `%s revert`" % (here, here),
              file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
