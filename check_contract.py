#!/usr/bin/env python3
"""check_contract.py - keep the native backends of a kernel repository honest.

Every backend lives in <root>/<backends-dir>/<platform>/<name>/ and is
described by <name>.backend.json.  The checker verifies that each manifest
tells the truth about its directory: the sources it declares, the ABI version
its headers define, what its build script builds and for which architectures.
The check reads text only: no compiler, no GPU, nothing is executed.  The
`build`, `test` and `parity` subcommands are the further tiers: they run the
build script, inspect the library it writes, and run the tests and the parity
reference of each backend.  `trace` runs each build script on a temporary
copy of the repository with every compiler replaced by a shim that records
its arguments, and checks the manifest against what the script really does.

Usage:
    check_contract.py [--root DIR] [--backends-dir DIR] [check]
                      [--format text|json|github|sarif] [--json] [--strict]
                      [--ignore CODE] [NAME ...]
    check_contract.py list [--buildable] [--format text|json|github-matrix] [--json]
    check_contract.py init DIR [--force] [--no-trace] [--format text|json|github] [--json]
    check_contract.py build [NAME ...] [--out DIR] [--arch A] [--timeout S]
                            [--format text|json|github] [--json] [--ignore CODE]
    check_contract.py test [NAME ...] [--timeout S] [--format text|json|github] [--json]
                           [--ignore CODE]
    check_contract.py parity [NAME ...] [--timeout S] [--format text|json|github] [--json]
                             [--ignore CODE]
    check_contract.py trace [NAME ...] [--arch A] [--timeout S] [--format text|json|github]
                            [--json] [--ignore CODE]

--format github (GitHub Actions annotations) is the default of every command
that offers it when GITHUB_ACTIONS=true.  A warning is accepted on purpose by
the manifest's "ignore": {"B017": "<why>"} or by --ignore B017: it is counted
in the summary line as suppressed and listed by --format json, never dropped.

NAME is a backend's directory name (`llm_ops`) or `<platform>/<name>`
(`cpu/llm_ops`).  Backends are reported as `<platform>/<name>`.

Text output (`--format text`, the default): one line per finding, sorted
by backend, path, line and code:
    <path>:<line>: [<level>] <CODE> <backend>: <message>
<path> is relative to the current directory when the file is inside it,
else to the repository root; `<path>: [...]` when the finding has no line
(a whole file or directory), and `[<level>] <CODE> <backend>: <message>`
when it has no place at all.  Then `checked <backend>: status=<status>
abi=<n>` per backend checked, and last `N backend(s), N error(s), N
warning(s)` (then `, N suppressed ...` when ignore entries accepted some).
Control characters in names and messages (a newline in a file name) are
written as backslash escapes (\n, \x1b), so every line of the report is
one finding.

Exit codes:
    0  no errors (for build/test/parity/trace: nothing failed)
    1  errors found (or warnings, with --strict); a build, test, parity or trace run failed;
       init cannot tell a value, or the script it wrote a manifest for must change
    2  usage error: no such repository root, no backends directory, a NAME
       that is no backend (a platform alone, such as `metal`, is none), bad flag;
       or standard output cannot be written (a full disk, a closed pipe)
    3  the checker's own failure: the trace's isolation cannot be set up (X005)
  130  interrupted (Ctrl-C)
A usage error is one line on stderr: `check_contract.py: error: <message>`.
docs/check_contract.md says what each code below means and how to fix it.

Diagnostic codes (stable; never reused):
    D  discovery     D001 kernel sources but no manifest, D002 manifest under a
                     wrong file name, D003 unknown platform directory (warning),
                     D004 directory cannot be listed, D005 kernel source directly
                     in a platform directory, D006 directory links out of the
                     repository, D007 no backend at all (warning)
    J  manifest file J001 invalid JSON, J002 duplicate key, J003 top level is
                     not an object, J004 manifest cannot be read
    M  manifest keys M001 required key missing, M002 wrong type or value,
                     M003 unknown key (warning), M004 name differs from the
                     directory, M005 platform differs from the directory,
                     M006 an ignore entry matches no warning (warning)
    S  sources       S001 declared source missing, S002 path escapes the
                     backend directory, S003 duplicate source, S004 kernel
                     source not declared, S005 source cannot be read,
                     S006 source is not UTF-8 (warning), S007 directory link
                     leading out of the backend directory, S008 a compiled
                     file undeclared, excluded or outside the backend
                     directory, S009 a declared source nothing compiles
                     (warning)
    A  ABI           A001 abi_version differs from the header macro,
                     A002 several ABI versions defined, A003 no ABI version
                     macro (warning; error when validated), A004 missing
                     <prefix>_abi_version / <prefix>_error_string declaration
                     (warning), A005 ABI version macro is not an integer literal
    B  build script  B001 script missing, B002 not executable in the working
                     tree, B003 not executable in the git index, B004 output
                     differs from build.output, B005 no compiler -o found,
                     B006 claimed architecture not built, B007 built
                     architecture not claimed, B008 default_arch not
                     in architectures, B009 default_arch differs from the
                     script's default, B010 architecture below min_capability,
                     B011 architecture is not a valid target for the platform,
                     B012 script has Windows (CRLF) line ends, B013 library not
                     written under <output-dir>, B014 no #! line or an interpreter
                     not on a standard system, B015 build.output absolute or
                     with .., B016 -D<PREFIX>_ABI_VERSION differs from
                     abi_version, B017 the script reader cannot tell (warning),
                     B018 a target flag the compiler rejects, B019 the default
                     invocation surely fails (set -e, set -u, exit)
    T  status        T001 validated without tolerances, T002 reference
                     entrypoint not given or missing (warning when experimental)
    O  models        O001 listed model directory missing (warning)
    R  build tier    R001 build script failed, R002 build timed out, R003
                     output missing, R004 output is not an ELF shared object,
                     R005 ABI symbol not exported, R006 loaded ABI version
                     differs, R007 library cannot be loaded here (warning),
                     R008 the targets in the library (CUDA SASS, HIP code
                     objects) differ from the manifest, R009 backend not
                     buildable, R010 an exported name without the backend's
                     prefix, R011 the targets cannot be verified (warning)
    U  test tier     U001 tests failed, U002 no tests beside the kernels
                     (warning), U003 tests timed out
    P  parity tier   P001 reference entrypoint failed, P002 timed out
    X  trace tier    X001 a compiler run by a path the shims do not intercept
                     (warning), X002 the script changed the checkout, X003 the
                     script failed where the shims are no toolkit (warning), X004 the
                     script changed the trace's own files (its shims, their
                     call log, <output-dir> itself), X005 the trace's isolation
                     cannot be set up (the checker's failure, exit status 3);
                     a traced run reports
                     R001/R002 when the script fails or times out, and the B
                     codes, marked "traced", when what it builds differs from
                     the manifest
"""

import argparse
import collections
import fnmatch
import json
import os
import posixpath
import re
import stat
import sys

VERSION = "1.0.0"

PLATFORMS = ("cpu", "cuda", "hip")
STATUSES = ("planned", "experimental", "validated")
# What a build could compile or include: CUDA and HIP, C, and C++ in every
# spelling gcc knows, with the inline and template parts headers pull in.
KERNEL_SUFFIXES = (".cu", ".cuh", ".hip", ".c", ".h", ".cpp", ".cc", ".cxx", ".cp", ".c++", ".C",
                   ".CPP", ".hpp", ".hh", ".hxx", ".hp", ".h++", ".H", ".HPP", ".inl", ".ipp",
                   ".tpp", ".tcc", ".inc")
# What a compiler compiles (the headers a file includes are not compiled on their own).
COMPILED_SUFFIXES = (".cu", ".hip", ".c", ".cpp", ".cc", ".cxx", ".cp", ".c++", ".C", ".CPP")
MANIFEST_SUFFIX = ".backend.json"
O_READ = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0)
SKIPPED_DIRS = (".git", "__pycache__")


NAME_RE = re.compile(r"[a-z0-9_]+\Z")
CODE_RE = re.compile(r"[DJMSABTORUPX][0-9]{3}\Z")  # a diagnostic code, as B017
CHECK_FAMILIES = "DJMSABTO"  # the codes `check` reports; the others are the tiers'
ARCH_FORMS = {
    "cuda": (re.compile(r"[1-9][0-9]{1,2}[a-z]?\Z"), 'a compute capability such as 89 or "90a"'),
    # A processor (gfx90a) or a generic target (gfx11-generic), feature settings after it.
    "hip": (re.compile(r"gfx(?:[0-9a-f]{3,4}|[0-9]{1,2}(?:-[0-9])?-generic)(?::[a-z]+[+-])*\Z"),
            'a gfx target such as "gfx942"'),
    # native is no target: it is whatever machine builds the library.
    "cpu": (re.compile(r"(?!native\Z)[a-z0-9][a-z0-9._+-]*\Z"), 'a -march value such as "x86-64"'),
}

# C sources: comments and string literals in one pass, so that `"//"` in a
# string is not taken for a comment; a backslash at the end of a line joins
# the next one to it, in a // comment too.
C_TOKEN_RE = re.compile(r'//(?:[^\n\\]|\\.)*|/\*.*?(?:\*/|\Z)|"(?:\\.|[^"\\\n])*"|\'(?:\\.|[^\'\\\n])*\'',
                        re.S)
C_DIRECTIVE_RE = re.compile(r"[ \t]*#[ \t]*([A-Za-z_][A-Za-z0-9_]*)?(.*)\Z", re.S)
C_NAME_RE = re.compile(r"[ \t]*([A-Za-z_][A-Za-z0-9_]*)")
C_INCLUDE_RE = re.compile(r'[ \t]*"([^"]+)"')
C_CALL_RE = re.compile(r"[ \t\n]*\(")
# The words of an #if expression: numbers, names and operators.
IF_TOKEN_RE = re.compile(r"[ \t]*(?:(0[xX][0-9a-fA-F]+|[0-9]+)[uUlL]*(?![A-Za-z0-9_.])"
                         r"|([A-Za-z_][A-Za-z0-9_]*)|(\|\||&&|<<|>>|<=|>=|==|!=|[-+*/%<>&|^!~()?:,]))")
IF_BINARY = {"*": 10, "/": 10, "%": 10, "+": 9, "-": 9, "<<": 8, ">>": 8, "<": 7, ">": 7,
             "<=": 7, ">=": 7, "==": 6, "!=": 6, "&": 5, "^": 4, "|": 3, "&&": 2, "||": 1}
IF_MAX_DEPTH = 64    # parentheses nested deeper leave an #if unevaluated
MAX_DIGITS = 18      # a number with more digits is no ABI version, target or #if value
ABI_SUFFIX = "_ABI_VERSION"
ABI_VALUE_RE = re.compile(r"[ \t]*\(?[ \t]*(0[xX][0-9a-fA-F]+|[0-9]+)[uUlL]*[ \t]*\)?[ \t\r]*\Z")
DIGITS_RE = re.compile(r"[0-9]+")
ABI_FUNCTION_RE = re.compile(r"(?<![A-Za-z0-9_])([A-Za-z_][A-Za-z0-9_]*?)_abi_version[ \t\n]*\(")

# Build scripts.
SH_TOKEN_RE = re.compile(r"""
    (?P<blank>(?:[ \t\r]|\\\n)+)
  | (?P<comment>\#[^\n]*)
  | (?P<newline>\n)
  | (?P<op>;;&|;;|;&|&&|\|\||\|&|[0-9]*(?:<<-|<<<|<<|>>|>&|<&|&>>|&>|>\||<>|[<>])|[;&|()])
  | (?P<word>(?:[^ \t\r\n'"\\$`;&|()<>]+|'[^']*'|\\[^\n]|\$\{[^{}"'`$]*\}|\$(?![('"{])
              |"(?:[^"\\$`]|\\.|\$\{[^{}"'`$]*\}|\$(?![('"{]))*")+)
  | (?P<other>.)
""", re.X | re.S)
# After a word SH_TOKEN_RE takes whole, one of these means it goes on.
SH_WORD_GOES_ON = ("$", "`", '"', "'", "\\")
# The parts of a word up to the first quote, expansion or end of word.
SH_PLAIN_RE = re.compile(r"[^ \t\r\n'\"\\$`;&|()<>]+")
SH_DOUBLE_PLAIN_RE = re.compile(r"[^\"\\$`]+")
SH_SPECIAL_RE = re.compile(r"[$'\"\\`]")
SH_NAME_RE = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")
SH_FUNCTION_NAME_RE = re.compile(r"[A-Za-z_][\w.:-]*\Z")
SH_ASSIGNMENT_RE = re.compile(r"([A-Za-z_][A-Za-z0-9_]*)(\[[^\]]*\])?(\+?)=", re.S)
SH_PARAM_RE = re.compile(r"([A-Za-z_][A-Za-z0-9_]*|[0-9]+|[#@*?$!-])(\[[^\]]*\])?"
                         r"(:?[-=?+]|%%|%|##|#|//|/|\^\^|\^|,,|,|:)?(.*)\Z", re.S)
# The expansions bash applies to each element of ${a[@]} / ${a[*]}.
SH_ELEMENT_OPS = ("%", "%%", "#", "##", "/", "//", "^^", "^", ",,", ",")
SH_FIELD_RE = re.compile("(?:\x03[^\x03]*\x03|\x04[^\x04]*\x04|[^ \t\n\x03\x04])+")
SH_LABEL_RE = re.compile("[\x03\x04]([^\x03\x04]*)[\x03\x04]")
SH_RESERVED = frozenset(("if", "then", "elif", "else", "fi", "case", "esac", "for", "while",
                         "until", "do", "done", "{", "}", "function", "!", "select"))
SH_REDIRECTS = re.compile(r"[0-9]*(?:<<-|<<<|<<|>>|>&|<&|&>>|&>|>\||<>|[<>])\Z")
# A redirection that writes no file: >/dev/null, &>/dev/null, 2>&1, >&-.
SH_NO_FILE_REDIRECT = (r"(?:[0-9]*(?:&>>?|>>?|>\|)\s*/dev/(?:null|stdout|stderr)|[0-9]*>&(?:[0-9]+|-))"
                       r"(?=[\s;&|)]|\Z)")
SH_NO_FILE_REDIRECT_RE = re.compile(SH_NO_FILE_REDIRECT)
# $(...) that only names the <output-dir> argument: out=$(mkdir -p "$1" && cd "$1" && pwd)
SH_WORD = r'((?:"[^"]*"|[^\s"])+)'  # a word, its quotes holding one level of quoted words
SH_SAME_DIR_RE = re.compile(r"(?:[^`]*(?:&&|;))?\s*(?:cd\s+(?:-P\s+|--\s+)?%s\s*(?:%s\s*)*(?:&&|;)\s*pwd(?:\s+-P)?"
                            r"|realpath\s+(?:-\w+\s+)*%s|readlink\s+-\w*[fem]\w*\s+%s)\s*\Z"
                            % (SH_WORD, SH_NO_FILE_REDIRECT, SH_WORD, SH_WORD))
# Set in any environment, so their value is the machine's, not the script's.
SH_RUNTIME_VARIABLES = frozenset(("HOME", "PATH", "PWD", "OLDPWD", "USER", "SHELL", "HOSTNAME",
                                  "LANG", "TMPDIR", "UID", "EUID", "RANDOM", "SECONDS", "LINENO",
                                  "BASH_SOURCE", "BASH_VERSION", "OSTYPE", "HOSTTYPE", "PPID"))
SH_DECLARE_WORDS = frozenset(("export", "local", "declare", "typeset", "readonly"))
# Commands that run the command after them: the options of each that take a
# value, and how many operands come before the command (timeout's duration).
SH_PREFIX_COMMANDS = {
    "exec": (("-a",), 0), "time": ((), 0), "nohup": ((), 0), "builtin": ((), 0),
    "command": ((), 0), "nice": (("-n", "--adjustment"), 0),
    "timeout": (("-s", "--signal", "-k", "--kill-after"), 1),
    "stdbuf": (("-i", "-o", "-e", "--input", "--output", "--error"), 0),
    "env": (("-u", "--unset"), 0)}
# Options of those that change what runs in a way the reader does not follow.
SH_PREFIX_UNFOLLOWED = ("-C", "--chdir", "-S", "--split-string")
# Commands whose success says something about the machine, not the script.
SH_QUERY_COMMANDS = frozenset(("grep", "egrep", "fgrep", "diff", "cmp", "pkg-config", "nvidia-smi",
                               "rocminfo", "rocm_agent_enumerator", "lspci", "ldconfig", "ls",
                               "stat", "find"))
# Commands that create no directory, whatever their arguments.
SH_MAKES_NO_DIRECTORY = frozenset(("cd", "pushd", "popd", "echo", "printf", "test", "[", "[[", ":",
                                   "true", "false", "shift", "set", "unset", "read", "exit", "return",
                                   "type", "which", "hash", "shopt", "dirname", "basename", "realpath",
                                   "readlink", "pwd", "ls", "cat", "grep", "nproc", "uname", "sleep",
                                   "export", "local", "declare", "readonly", "typeset"))
# Commands that compile nothing, whatever files they are given (cp, mv, ln, rm are builtins).
SH_FILE_TOOLS = SH_MAKES_NO_DIRECTORY | SH_QUERY_COMMANDS | frozenset((
    "sed", "awk", "gawk", "touch", "chmod", "chown", "head", "tail", "tee", "wc", "sort", "uniq", "tr",
    "cut", "patch", "git", "clang-format", "tar", "file", "md5sum", "sha1sum", "sha256sum", "xxd",
    "mkdir", "rmdir"))
SH_BUILD_TOOLS = frozenset(("make", "gmake", "cmake", "ninja", "meson", "scons", "bazel"))
# Programs that run commands of their own, which the reader does not see.
SH_PROGRAM_RE = re.compile(r"(?:(?:ba|da|z|k)?sh|python[0-9.]*|perl|ruby|node|xargs|parallel)\Z")
SH_ARITH_ASSIGNMENT_RE = re.compile(r"([A-Za-z_][A-Za-z0-9_]*)\s*(?:\+\+|--|(?:[-+*/%&|^]|<<|>>)?=(?!=))"
                                    r"|(?:\+\+|--)\s*([A-Za-z_][A-Za-z0-9_]*)")
# The options of set and #! that the reader follows, by letter.
OPTION_LETTERS = {"e": "errexit", "u": "nounset"}
SHEBANG_OPTIONS_RE = re.compile(r"#![ \t]*/(?:usr/)?bin/bash[ \t]+-([a-zA-Z]+)[ \t]*\n")
POSIX_SHEBANG_RE = re.compile(r"#![ \t]*(?:/(?:usr/)?bin/(?:da)?sh|/usr/bin/env[ \t]+(?:da)?sh)[ \t]*\n")
# Set by bash itself, or in any environment: never unset under set -u.
SH_SHELL_VARIABLES_RE = re.compile(r"(?:BASH\w*|COMP_\w+|HIST\w*|IFS|OPTIND|OPTERR|PS[1-4]|SHLVL"
                                   r"|MACHTYPE|GROUPS|PIPESTATUS|FUNCNAME|DIRSTACK|SRANDOM|EPOCH\w+"
                                   r"|SHELLOPTS|BASHOPTS|MAILCHECK|TERM|_)\Z")
SH_NO_FILES = ("/dev/null", "/dev/stdout", "/dev/stderr")  # redirections that write no file
# $(dirname "$0"), $(cd "$(dirname "$0")/.." && pwd): no other expansion, so the
# text names one directory wherever it is met.
SH_DIRNAME_RE = re.compile(r"\s*dirname\s+(?:--\s+)?%s\s*\Z" % SH_WORD)
SH_ONLY_SCRIPT_RE = re.compile(r"\$(?![0(]|\{0\}|\{?BASH_SOURCE\b)|`")
# Where bash runs the script (not sourced), ${BASH_SOURCE[0]} is its $0.
BASH_SHEBANG_RE = re.compile(r"#![ \t]*(?:/(?:usr/)?bin/|/usr/bin/env[ \t]+)bash\b")
SH_SCRIPT_PATHS = ("$0", "${BASH_SOURCE[0]}", "${BASH_SOURCE}", "$BASH_SOURCE")
SH_MAX_CHARS = 1 << 16   # a value longer than this is given up (v+=$v doubles it)
SH_MAX_STEPS = 20000     # commands followed per script, loops and functions included
SH_MAX_DEPTH = 32        # nested function calls and sourced files
SH_MAX_LOOPS = 256       # runs of a while loop's body

# Marks in a value the script reader expands: NOT_REACHED stands for an
# argument the default invocation does not pass ($2), OUT_DIR for its
# <output-dir> argument ($1).  RUNTIME...RUNTIME encloses the text of a value
# computed when the script runs (a command's output, $0, $HOME): not the
# <output-dir>, but nothing the reader can know; UNDECIDED...UNDECIDED the text
# of one it cannot decide (set differently by the branches of a condition it
# cannot decide, or where it does not follow the script).
NOT_REACHED = "\x01"
OUT_DIR = "\x02"
RUNTIME = "\x03"
UNDECIDED = "\x04"
MARKERS = (NOT_REACHED, OUT_DIR, RUNTIME, UNDECIDED)

HELP_EXAMPLES = """\
examples:
  python3 check_contract.py --root .            check every backend (the CI call)
  python3 check_contract.py check --strict cpu/llm_ops
  python3 check_contract.py --format github          annotations for GitHub Actions
  python3 check_contract.py list --buildable --format github-matrix
  python3 check_contract.py init backends/cuda/flash_attn
  python3 check_contract.py build --out build/backends
  python3 check_contract.py build cuda/llm_ops --arch 90
  python3 check_contract.py test && python3 check_contract.py parity
"""


# ---------------------------------------------------------------------------
# Data types


class Diagnostic:
    """One finding: what is wrong, where, and how bad."""

    __slots__ = ("level", "code", "backend", "path", "line", "message", "suppressed")

    def __init__(self, level, code, backend, path, line, message):
        self.level = level
        self.code = code
        self.backend = backend
        self.path = path
        self.line = line
        self.message = message
        self.suppressed = None  # why the finding is accepted, when an ignore entry matches it

    def sort_key(self):
        return (self.backend, self.path or "", self.line or 0, self.code, self.message)

    def as_dict(self):
        found = {"level": self.level, "code": self.code, "backend": self.backend,
                 "path": self.path, "line": self.line, "message": self.message}
        if self.suppressed is not None:
            found["reason"] = self.suppressed
        return found


class Backend:
    """A discovered backend directory and what its manifest says about it.

    Fields derived from the manifest are None when the manifest does not give
    them in a usable form; the checks report why.
    """

    __slots__ = ("name", "platform", "dir", "rel_dir", "manifest_path", "manifest",
                 "status", "abi_version", "abi_prefix", "build_script", "output",
                 "architectures", "default_arch", "files", "diagnostics", "index_path",
                 "sources", "ignore", "manifest_text", "key_lines", "owned")

    def __init__(self, name, platform, dir, rel_dir):
        self.name = name
        self.platform = platform
        self.dir = dir
        self.rel_dir = rel_dir
        self.manifest_path = dir + "/" + name + MANIFEST_SUFFIX
        self.manifest = None
        self.status = None
        self.abi_version = None
        self.abi_prefix = None
        self.build_script = None
        self.output = None
        self.architectures = None
        self.default_arch = None
        self.files = {}
        self.diagnostics = []
        self.index_path = None  # the build script, when its git index mode is to be checked
        self.sources = ()  # (as written, normalized or None, problem) per non-empty string
        self.ignore = {}  # code -> why its warnings are accepted, from the manifest's "ignore"
        self.manifest_text = None  # the manifest as read, for the lines of its keys
        self.key_lines = None  # manifest_lines() of it, worked out for the first finding that asks
        # A flat backend (the manifest directly in the platform directory): the
        # directories of the platform directory it owns; None for <platform>/<name>/.
        self.owned = None

    @property
    def key(self):
        return self.platform + "/" + self.name

    def rel(self, path):
        """Repository-relative path of a path relative to the backend directory."""
        return self.rel_dir + "/" + path

    def report(self, level, code, message, path=None, line=None, key=None):
        """Record a finding; one with no more precise place points at the
        manifest, at the line of `key` ("build.output", "sources[1]") when
        it names one."""
        manifest = self.rel(self.name + MANIFEST_SUFFIX)
        path = path or manifest
        if line is None and key is not None and path == manifest:
            line = self.line_of(key)
        self.diagnostics.append(Diagnostic(level, code, self.key, path, line, message))

    def error(self, code, message, path=None, line=None, key=None):
        self.report("error", code, message, path, line, key)

    def warning(self, code, message, path=None, line=None, key=None):
        self.report("warning", code, message, path, line, key)

    def line_of(self, key):
        """The manifest's line of a key or list item, or None."""
        if self.key_lines is None:
            self.key_lines = manifest_lines(self.manifest_text) if self.manifest_text else {}
        return self.key_lines.get(key)


class CannotTell(Exception):
    """init cannot tell a value of the manifest: the message names it and
    what to write; nothing is written, and the exit status is 1."""


class UsageError(Exception):
    """A mistake on the command line; reported in one line, exit status 2."""


class IsolationError(Exception):
    """The trace's isolation cannot be set up where the probe said it can:
    the checker's own failure (X005), not the script's, which did not run;
    reported in one line, exit status 3."""


class Repository:
    """The repository being checked, and what is shared by all its backends."""

    def __init__(self, root, backends_dir, git=None):
        self.root = root
        self.real_root = os.path.realpath(root)
        self.backends_dir = backends_dir.strip("/") or "."
        self.backends_path = os.path.join(root, self.backends_dir)
        self.git = git  # the GitWorkTree holding the root, or None
        self.unlisted = []  # D004 and D006 findings of candidate_dirs()
        self.real_dirs = {}  # real_directory()'s answers

    def real_directory(self, rel):
        """os.path.realpath of a normalized repository-relative directory."""
        return real_directory(os.path.abspath(os.path.join(self.root, rel)), self.real_dirs)

    def inside(self, path):
        """Whether a path, its links resolved, stays inside the repository."""
        real = os.path.realpath(path)
        return real == self.real_root or real.startswith(self.real_root.rstrip("/") + "/")


def run_git(top, *args, env=None):
    """The output of a git command run in `top` (None: here) with `env`
    (None: this process's), or None when git cannot be run there or fails."""
    import subprocess
    try:
        done = subprocess.run(("git",) + args, cwd=top, env=env, stdin=subprocess.DEVNULL,
                              stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, check=False)
    except OSError:
        return None
    return done.stdout if done.returncode == 0 else None


class GitWorkTree:
    """What git knows of the work tree that holds the repository: the modes
    of the files in its index and the files it ignores, each listed once per
    run.  Paths are relative to the work tree's top, as git writes them."""

    def __init__(self, top):
        self.top = top
        self._modes = None
        self._ignored = None
        self._real_dirs = {}

    @classmethod
    def find(cls, directory):
        """The work tree holding `directory`; None outside one, or when git
        cannot be run."""
        found = run_git(directory, "rev-parse", "--show-toplevel")
        if not found or not found.strip():
            return None
        top = os.fsdecode(found.rstrip(b"\n"))
        return cls(os.path.realpath(top))

    def relative(self, path):
        """The git path of a file (its directories' links resolved, the file
        itself not), or None outside the work tree."""
        directory, name = os.path.split(os.path.abspath(path))
        real = os.path.join(real_directory(directory, self._real_dirs), name)
        if real == self.top:
            return ""
        if not real.startswith(self.top.rstrip("/") + "/"):
            return None
        return real[len(self.top.rstrip("/")) + 1:].replace(os.sep, "/")

    def mode(self, path):
        """The index mode ("100755") of a file, or None if git does not track it."""
        if self._modes is None:
            listing = run_git(self.top, "ls-files", "-s", "-z", "--full-name") or b""
            self._modes = {}
            for entry in listing.split(b"\0"):
                info, _, name = entry.partition(b"\t")
                if name:
                    self._modes[os.fsdecode(name)] = info[:6].decode("ascii", "replace")
        rel = self.relative(path)
        return None if rel is None else self._modes.get(rel)

    def ignored_paths(self):
        """The set of ignored, untracked paths; an ignored directory ends in /
        and is not listed further."""
        if self._ignored is None:
            listing = run_git(self.top, "ls-files", "-z", "--others", "--ignored",
                              "--exclude-standard", "--directory") or b""
            self._ignored = {os.fsdecode(p) for p in listing.split(b"\0") if p}
        return self._ignored

    def ignores(self, rel):
        """Whether git ignores a git path (a directory's ending in /), or a
        directory above it."""
        ignored = self.ignored_paths()
        if not ignored:
            return False
        if rel in ignored:
            return True
        at = rel.find("/")
        while 0 <= at < len(rel) - 1:
            if rel[:at + 1] in ignored:
                return True
            at = rel.find("/", at + 1)
        return False


def real_directory(directory, known):
    """os.path.realpath of an absolute, normalized directory; `known` keeps
    the answers for it and the directories above it, so that each new
    directory costs one lstat."""
    real = known.get(directory)
    if real is None:
        parent, name = os.path.split(directory)
        if not name or parent == directory or os.path.islink(directory):
            real = os.path.realpath(directory)
        else:
            real = os.path.join(real_directory(parent, known), name)
        known[directory] = real
    return real


# ---------------------------------------------------------------------------
# Helpers


def describe(value):
    """A short JSON-ish rendering of a manifest value for a message."""
    try:
        text = json.dumps(value, allow_nan=True)
    except (TypeError, ValueError, RecursionError):  # an int too long to print, deep nesting
        return {int: "an integer too long to print", list: "a list nested too deeply",
                dict: "an object nested too deeply"}.get(type(value), type(value).__name__)
    return text if len(text) <= 40 else text[:37] + "..."


def is_int(value):
    return isinstance(value, int) and not isinstance(value, bool)


READ_CHUNK = 1 << 16


def read_bytes(path, regular=False):
    """(data, error, st_mode): the file's bytes, or None and a one-line reason
    it cannot be read.

    Only regular files are read (a FIFO would block).  `regular` says the
    caller already knows the path is one (the directory walk saw it): that
    spares the fstat, one system call per file, and st_mode is then None.
    """
    mode = None
    try:
        fd = os.open(path, O_READ)
    except OSError as exc:
        return None, exc.strerror or str(exc), None
    try:
        if not regular:
            mode = os.fstat(fd).st_mode
            if not stat.S_ISREG(mode):
                return None, "not a regular file", mode
        # A regular file reads in full unless it fills the chunk.
        data = os.read(fd, READ_CHUNK)
        if len(data) == READ_CHUNK:
            chunks = [data]
            while chunks[-1]:
                chunks.append(os.read(fd, READ_CHUNK))
            data = b"".join(chunks)
    except OSError as exc:
        return None, exc.strerror or str(exc), mode
    finally:
        os.close(fd)
    return data, None, mode


def decode(data):
    """(text, bad_byte): bytes that are not UTF-8 are replaced; bad_byte is
    the offset of the first one, or None."""
    try:
        return data.decode("utf-8"), None
    except UnicodeDecodeError as exc:
        return data.decode("utf-8", "replace"), exc.start


def read_text(path, regular=False):
    """(text, error, bad_byte): read_bytes, decoded."""
    data, problem, _ = read_bytes(path, regular)
    if data is None:
        return None, problem, None
    text, bad_byte = decode(data)
    return text, None, bad_byte


def walk_files(top, unlisted=None, ignored=None):
    """Map every entry below `top` (relative POSIX path) to its kind.

    Kinds: "file" (regular file), "link" (symbolic link, never followed, so a
    link loop cannot trap the walk and no link leads it out of `top`),
    "other".  Every directory is descended into, hidden ones too (a build
    compiles .impl/x.cu as well as impl/x.cu), except .git and __pycache__,
    and those `ignored` (a function of the relative path, a directory's
    ending in /) says git ignores.  A directory that cannot be listed is added
    to `unlisted` as (relative path, reason).
    """
    files = {}
    pending = [("", top)]
    while pending:
        prefix, path = pending.pop()
        try:
            entries = os.scandir(path)
        except OSError as exc:
            if unlisted is not None:
                unlisted.append((prefix.rstrip("/"), exc.strerror or str(exc)))
            continue
        with entries:
            for entry in entries:
                rel = prefix + entry.name
                try:
                    # The entry's type from the directory listing: regular
                    # files first, the common case, with no stat.
                    if entry.is_file(follow_symlinks=False):
                        kind = "file"
                    elif entry.is_dir(follow_symlinks=False):
                        if entry.name not in SKIPPED_DIRS and not (ignored and ignored(rel + "/")):
                            pending.append((rel + "/", entry.path))
                        continue
                    elif entry.is_symlink():
                        kind = "link"
                    else:
                        kind = "other"
                except OSError:
                    kind = "other"
                if not (ignored and ignored(rel)):
                    files[rel] = kind
    return files


def is_kernel_source(path):
    return path.endswith(KERNEL_SUFFIXES)


NUL_PROBLEM = "contains a NUL character, which no file name can hold"
SURROGATE_PROBLEM = "contains an unpaired surrogate, which no UTF-8 file name can hold"


def normalize_relpath(path):
    """The normalized form of a backend-relative path, or a reason it is refused."""
    if "\0" in path:
        return None, NUL_PROBLEM
    if not path.isascii():
        try:
            path.encode("utf-8")
        except UnicodeEncodeError:
            return None, SURROGATE_PROBLEM
    if "/" not in path and path not in ("", ".", ".."):
        return path, None
    if not path:
        return None, "is empty"
    if path.startswith("/"):
        return None, "is absolute; give it relative to the backend directory"
    parts = [p for p in path.split("/") if p not in ("", ".")]
    if ".." in parts:
        return None, "contains '..'; sources must stay inside the backend directory"
    if not parts:
        return None, "names the backend directory itself"
    return "/".join(parts), None


def nearest(word, choices):
    import difflib
    found = difflib.get_close_matches(word, choices, n=1, cutoff=0.6)
    return found[0] if found else None


def glob_matches(pattern, path):
    import fnmatch
    if "/" not in pattern:
        return fnmatch.fnmatchcase(path.rsplit("/", 1)[-1], pattern)
    return fnmatch.fnmatchcase(path, pattern)


ARCH_NUMBERS = {}  # arch -> its leading number, or None


def arch_number(arch):
    number = ARCH_NUMBERS.get(arch, False)
    if number is False:
        digits = DIGITS_RE.match(arch)
        number = ARCH_NUMBERS[arch] = (int(digits.group()) if digits and len(digits.group()) <= MAX_DIGITS
                                       else None)
    return number


# ---------------------------------------------------------------------------
# Reading C sources


def strip_c_comments(text):
    """Text with comments blanked (newlines kept, so line numbers hold), and
    without a UTF-8 byte-order mark, which the preprocessor skips."""
    if text.startswith("\ufeff"):
        text = text[1:]

    def blank(match):
        token = match.group()
        if token[0] == "/":
            return "\n" * token.count("\n") + " "
        return token
    return C_TOKEN_RE.sub(blank, text)


def preprocess(text):
    """(live text, directives) of a C source: the text without comments and
    with the lines of dead conditional branches blanked, and the directives
    of the live lines as [(line, name, rest)], a continued directive joined
    and given at its first line.

    A branch is dead when its #if or #elif has the value 0 (see if_value),
    or an earlier branch of its chain surely was taken; a branch whose
    condition cannot be evaluated (#ifdef, a macro) counts, like the one
    after it: both may be compiled.
    """
    lines = strip_c_comments(text).split("\n")
    frames = []  # [enclosing branch live, this branch live, a branch surely taken]
    live = True
    directives = []
    index = 0
    while index < len(lines):
        line = lines[index]
        match = C_DIRECTIVE_RE.match(line) if "#" in line else None
        if match is None:
            if not live:
                lines[index] = ""
            index += 1
            continue
        first, rest = index, match.group(2)
        while rest.endswith("\\") and index + 1 < len(lines):
            index += 1
            rest = rest[:-1] + " " + lines[index]
        name = match.group(1)
        if name in ("if", "ifdef", "ifndef"):
            value = if_value(rest) if live and name == "if" else (None if live else 0)
            frames.append([live, value != 0, value not in (None, 0)])
        elif name in ("elif", "elifdef", "elifndef", "else") and frames:
            frame = frames[-1]
            if frame[2]:
                frame[1] = False
            else:
                value = if_value(rest) if frame[0] and name == "elif" else None
                frame[1], frame[2] = value != 0, value not in (None, 0)
        elif name == "endif" and frames:
            frames.pop()
        elif live and name:
            directives.append((first + 1, name, rest))
        live = not frames or (frames[-1][0] and frames[-1][1])
        if not live:
            lines[first:index + 1] = [""] * (index + 1 - first)
        index += 1
    return "\n".join(lines), directives


class Unevaluable(Exception):
    """An #if expression that this reader cannot give a value."""


def if_value(expression):
    """The value of an #if expression of integer literals, as the
    preprocessor computes it (64-bit), or None when it cannot be told here:
    it names a macro or defined(), or is beyond what this evaluator reads."""
    tokens = []
    pos, end = 0, len(expression.rstrip())
    while pos < end:
        match = IF_TOKEN_RE.match(expression, pos)
        if match is None:
            return None
        number, name, operator = match.groups()
        if number is not None:
            if len(number) > MAX_DIGITS or re.match(r"0[0-7]*[89]", number):
                return None  # 08, 09: no octal number, an error to cpp and bash alike
            tokens.append(int(number, 16) if number[:2] in ("0x", "0X")
                          else int(number, 8) if number[0] == "0" and number.isdigit()
                          and set(number) <= set("01234567") else int(number))
        else:
            tokens.append(name if name is not None else operator)
        pos = match.end()
    try:
        value, at = if_conditional(tokens, 0, 0)
    except (Unevaluable, IndexError, ValueError):
        return None
    return value if at == len(tokens) else None


def if_conditional(tokens, at, depth):
    """(value, next position) of `a ? b : c` or a binary expression."""
    value, at = if_binary(tokens, at, 1, depth)
    if at < len(tokens) and tokens[at] == "?":
        first, at = if_conditional(tokens, at + 1, depth + 1)
        if tokens[at] != ":":
            raise Unevaluable()
        second, at = if_conditional(tokens, at + 1, depth + 1)
        value = None if value is None else first if value else second
    return value, at


def if_binary(tokens, at, lowest, depth):
    value, at = if_unary(tokens, at, depth)
    while at < len(tokens) and type(tokens[at]) is str and IF_BINARY.get(tokens[at], 0) >= lowest:
        operator = tokens[at]
        right, at = if_binary(tokens, at + 1, IF_BINARY[operator] + 1, depth)
        value = if_apply(operator, value, right)
    return value, at


def if_unary(tokens, at, depth):
    if depth > IF_MAX_DEPTH:
        raise Unevaluable()
    token = tokens[at]
    if type(token) is int:
        return token, at + 1
    if token == "(":
        value, at = if_conditional(tokens, at + 1, depth + 1)
        if tokens[at] != ")":
            raise Unevaluable()
        return value, at + 1
    if token in ("!", "~", "-", "+"):
        value, at = if_unary(tokens, at + 1, depth + 1)
        if value is not None:
            value = {"!": int(not value), "~": ~value, "-": -value, "+": value}[token]
        return value, at
    if token in ("true", "false"):
        return int(token == "true"), at + 1
    if token in IF_BINARY or token in ("?", ":", ")", ","):
        raise Unevaluable()
    # A macro, defined(X), or a function-like name: skip its argument list.
    at += 1
    if token == "defined" and tokens[at] != "(":
        return None, at + 1
    if at < len(tokens) and tokens[at] == "(":
        open_parens = 0
        while True:
            open_parens += {"(": 1, ")": -1}.get(tokens[at], 0) if type(tokens[at]) is str else 0
            at += 1
            if open_parens == 0:
                break
    return None, at


def if_apply(operator, left, right):
    """A binary operator on values that may be unknown (None)."""
    if operator == "&&":
        if left == 0 or right == 0:
            return 0
        return None if left is None or right is None else 1
    if operator == "||":
        if left not in (None, 0) or right not in (None, 0):
            return 1
        return None if left is None or right is None else 0
    if left is None or right is None:
        return None
    if operator in ("/", "%"):
        if right == 0:
            return None
        quotient = abs(left) // abs(right) * (1 if (left < 0) == (right < 0) else -1)
        return quotient if operator == "/" else left - right * quotient
    if operator in ("<<", ">>"):
        if not 0 <= right < 64:
            return None
        value = left << right if operator == "<<" else left >> right
    else:
        value = {"*": lambda: left * right, "+": lambda: left + right, "-": lambda: left - right,
                 "<": lambda: int(left < right), ">": lambda: int(left > right),
                 "<=": lambda: int(left <= right), ">=": lambda: int(left >= right),
                 "==": lambda: int(left == right), "!=": lambda: int(left != right),
                 "&": lambda: left & right, "^": lambda: left ^ right,
                 "|": lambda: left | right}[operator]()
    return value if -(1 << 63) <= value < (1 << 64) else None


def abi_value(raw):
    """The integer an ABI macro's replacement text spells, or None."""
    value = ABI_VALUE_RE.match(raw)
    if value is None:
        return None
    digits = value.group(1)
    if len(digits) > MAX_DIGITS:
        return None
    if digits[:2] in ("0x", "0X"):
        return int(digits, 16)
    if len(digits) > 1 and digits[0] == "0":
        return int(digits, 8) if set(digits) <= set("01234567") else None
    return int(digits)


def macro_events(directives):
    """What the directives of a file do to ABI macros, in order:
    ("define", line, prefix, value or None, raw value), ("undef", line,
    prefix), and ("include", line, quoted file name)."""
    events = []
    for line, name, rest in directives:
        if name == "include":
            included = C_INCLUDE_RE.match(rest)
            if included:
                events.append(("include", line, included.group(1)))
            continue
        if name not in ("define", "undef"):
            continue
        macro = C_NAME_RE.match(rest)
        if macro is None or not macro.group(1).endswith(ABI_SUFFIX) or len(macro.group(1)) == len(ABI_SUFFIX):
            continue
        prefix = macro.group(1)[:-len(ABI_SUFFIX)]
        if name == "undef":
            events.append(("undef", line, prefix))
        else:
            raw = rest[macro.end():]
            events.append(("define", line, prefix, abi_value(raw), raw.strip()))
    return events


def find_abi_defines(text):
    """[(prefix, value or None, line, raw value)] for each ABI version macro
    a source defines in its live lines, in order (an #undef dropping those
    before it)."""
    found = []
    for event in macro_events(preprocess(text)[1]):
        if event[0] == "define":
            found.append((event[2], event[3], event[1], event[4]))
        elif event[0] == "undef":
            found = [d for d in found if d[0] != event[2]]
    return found


# ---------------------------------------------------------------------------
# Compiler calls: what one call builds, read from its words.  The script
# reader and the trace both hand their calls to compiler_call(), and compare
# what a script does with its manifest in check_build_facts().

COMPILER_WRAPPERS = ("ccache", "sccache", "env")
ENV_WORD_RE = re.compile(r"[A-Za-z_][A-Za-z0-9_]*=")
ABI_DEFINE_FLAG_RE = re.compile(r"([A-Za-z_][A-Za-z0-9_]*?)_ABI_VERSION=(.*)\Z", re.S)
GENCODE_RE = re.compile(r"arch=(\w+),code=(\[[^\]]*\]|\"[^\"]*\"|\w+)\Z")
CUDA_CODE_ITEM_RE = re.compile(r"(sm|compute)_([0-9]+[a-z]?)\Z")
CUDA_TARGET_TYPO_RE = re.compile(r"(sm|compute)[-_]?([0-9]+[a-z]?)\Z")  # sm90, compute-90
OPEN_TARGETS = ("all", "all-major", "native")
LINKED_SUFFIXES = (".o", ".obj", ".a")  # what a link takes in whole (a shared library it only names)
# Where CMake, Meson and configure test a compiler (its identification, try_compile,
# conftest.c): a call that compiles or writes there, or runs there, is a probe, not the build.
PROBE_PLACE_RE = re.compile(r"(?:^|/)(?:CMakeFiles/(?:(?:CMakeScratch|CMakeTmp|[0-9][0-9.]*/CompilerId"
                            r"[A-Za-z]*)(?:/|\Z)|[0-9][0-9.]*/CMakeDetermineCompilerABI_)"
                            r"|meson-private/|conftest(?:\.[A-Za-z0-9+]+)?\Z)")
OPTION_FILE_DEPTH = 8  # options files named by options files that the reader follows
OPTION_FILE_WORD_RE = re.compile(r'(?:"[^"]*"|[^\s"])+')


def options_file_words(text):
    """The words of an nvcc options file: white space apart, double quotes
    grouping (and removed), single quotes kept, as nvcc reads it."""
    return [w.replace('"', "") for w in OPTION_FILE_WORD_RE.findall(text)]


def response_file_words(text):
    """The words of a gcc or clang response file, quoted as in the shell;
    None where the quotes do not close."""
    import shlex
    try:
        return shlex.split(text)
    except ValueError:
        return None


class Compiler:
    """What the checker knows of one compiler beyond the flags all share
    (COMPILER_OPTIONS): the variables whose words it reads before and after
    its arguments, its options that name files of more arguments and how it
    splits such a file into words, and whether -oFILE names its output
    (nvcc's -odir and -optf are other options)."""

    __slots__ = ("prepend", "append", "option_files", "option_words", "joined_output")

    def __init__(self, prepend=None, append=None, option_files=("@",), option_words=None,
                 joined_output=True):
        self.prepend, self.append = prepend, append
        self.option_files = option_files  # "@": @FILE, as gcc and clang take a response file
        self.option_words = option_words or response_file_words
        self.joined_output = joined_output

    def arguments(self, args, environment):
        """Its arguments as it reads them: the words of its variables (split
        at white space, quotes kept, as nvcc splits them) around args."""
        before, after = (environment.get(v) or "" if v else "" for v in (self.prepend, self.append))
        return before.split() + list(args) + after.split()


# One row per compiler: what the script reader, the trace's shims (one shim
# per name, and its versioned forms) and the reading of recorded calls know of it.
COMPILERS = {
    "nvcc": Compiler("NVCC_PREPEND_FLAGS", "NVCC_APPEND_FLAGS", ("-optf", "--options-file"),
                     options_file_words, joined_output=False),
    "hipcc": Compiler(append="HIPCC_COMPILE_FLAGS_APPEND"), "clang": Compiler(),
    "clang++": Compiler(), "amdclang": Compiler(), "amdclang++": Compiler(), "gcc": Compiler(),
    "g++": Compiler(), "cc": Compiler(), "c++": Compiler(), "icx": Compiler(), "icpx": Compiler()}
COMPILERS["hipcc.pl"] = COMPILERS["hipcc"]  # older ROCm's hipcc itself
LINKERS = ("ld", "ld.lld")  # read as a link, never shimmed: gcc runs them itself
ANY_COMPILER = Compiler(option_files=())
# A command word naming a compiler: x86_64-linux-gnu-gcc-12, clang++-18.
COMPILER_NAME_RE = re.compile(r"(?:[A-Za-z0-9_]+-)*?(%s)(?:-[0-9]+(?:\.[0-9]+)*)?\Z" % "|".join(
    re.escape(name) for name in sorted(tuple(COMPILERS) + LINKERS, key=len, reverse=True)))


def compiler_row(word):
    """The COMPILERS row of a command word (/usr/bin/nvcc, gcc-12)."""
    match = COMPILER_NAME_RE.match(word.rsplit("/", 1)[-1])
    return COMPILERS.get(match.group(1), ANY_COMPILER) if match else ANY_COMPILER


# Options that make a compiler build something else than machine code: a
# probe (-E, -M, -fsyntax-only, nvcc --dryrun) builds nothing, nvcc -ptx
# builds PTX only.
COMPILER_MODES = {
    "-E": "probe", "--preprocess": "probe", "-M": "probe", "-MM": "probe",
    "--generate-dependencies": "probe", "--generate-nonsystem-dependencies": "probe",
    "-fsyntax-only": "probe", "--dryrun": "probe", "-ptx": "ptx", "--ptx": "ptx"}
# What compiler_call() reads of each option, given as `-x v` or `-x=v`.
COMPILER_OPTIONS = {
    "-o": "output", "--output-file": "output", "-D": "define", "--define-macro": "define",
    "-gencode": "gencode", "--generate-code": "gencode", "-arch": "arch",
    "--gpu-architecture": "arch", "-code": "code", "--gpu-code": "code",
    "--offload-arch": "offload", "--amdgpu-target": "offload", "--cuda-gpu-arch": "offload",
    "--targets": "targets", "-march": "march", "-mcpu": "mcpu"}


class CompilerCall:
    """The facts of one compiler call.

    outputs: the files its -o names (probes to /dev/null apart), relative
    paths joined to the directory it ran in when that is known; sass, ptx,
    hip, march and mcpu: the targets it builds (nvcc machine code, nvcc PTX
    only, AMD gfx targets, CPU -march and -mcpu values, of which the last
    counts); open_targets: -arch=all, all-major or native, which are no
    fixed list; abi_defines: (PREFIX, value) of each
    -D<PREFIX>_ABI_VERSION=value; unknown: its words the reader cannot tell
    (a target flag whose value it cannot know, a word that may hold target
    flags); rejected: why the compiler refuses a target flag, with its right
    spelling; condition: None when the default invocation surely makes this
    call, else why it may not (a condition the reader cannot decide).
    """

    __slots__ = ("compiler", "line", "outputs", "probes", "sass", "ptx", "hip", "march", "mcpu",
                 "open_targets", "abi_defines", "unknown", "rejected", "condition", "inputs",
                 "objects", "opaque", "after_write", "languages")

    def __init__(self, compiler, line):
        self.compiler = compiler
        self.line = line
        self.outputs = []
        self.inputs = []  # the files it compiles, joined to its directory as the outputs are
        self.objects = []  # the object files and archives it links, joined the same way
        self.opaque = False  # whether a word it is given cannot be told (which files it links)
        self.probes = 0
        self.sass, self.ptx, self.hip, self.march, self.mcpu = [], [], [], [], []
        self.open_targets = []
        self.abi_defines = []
        self.unknown = []
        self.rejected = []
        self.condition = None
        self.after_write = True  # whether a command before it may have written a file it reads
        self.languages = set()  # what -x says its inputs are (cu, cuda, hip)

    def names_no_target(self, platform):
        """Whether the call compiles code for a platform with no flag naming a
        target, so that it builds its compiler's default (nvcc 13 sm_75, CUDA
        12 sm_52; gcc the distribution's -march; hipcc the machine's GPU)."""
        if not self.inputs or self.targets(platform) or self.ptx or self.open_targets or \
                self.unknown or self.rejected:
            return False
        language = self.languages & {"cuda": {"cu", "cuda"}, "hip": {"hip"}}.get(platform, set())
        name = COMPILER_NAME_RE.match(self.compiler)
        hip = name is not None and name.group(1) in ("hipcc", "hipcc.pl", "amdclang", "amdclang++")
        suffixes = {"cuda": (".cu",), "hip": COMPILED_SUFFIXES if hip else (".hip",)}.get(
            platform, COMPILED_SUFFIXES)  # gcc's .cpp in a cuda backend is host code
        return bool(language) or any(path.endswith(suffixes) for path in self.inputs)

    def targets(self, platform):
        """The architectures this call builds machine code for on a platform
        (on any, for a platform the checker does not know).  gcc and clang
        take the last -march (else the last -mcpu: aarch64, ppc64le)."""
        cpu = self.march[-1:] or self.mcpu[-1:]
        targets = {"cuda": self.sass, "hip": self.hip, "cpu": cpu}
        return targets.get(platform, self.sass + self.hip + cpu)


def linked_calls(calls, library=None):
    """The calls whose code reaches the library: the last call that writes
    `library` (else the last with an output), and for each object file or
    archive it links the call that wrote it, and so on.  The targets of a
    link of objects alone are those of its objects (nvcc's own flags there
    build only its device-link stub).  Every call, where the link has a word
    the checker cannot tell or links a file no call is seen writing (an
    archive ar made), or a call builds targets into a file it names itself
    (-c without -o): then which calls reach the library cannot be told."""
    writing = [c for c in calls if c.outputs]
    if any(c.inputs and not c.outputs and c.targets(None) for c in calls):
        return list(calls)  # an object named by the compiler (-c, -odir): where it went is not told
    if library is not None:
        writing = [c for c in writing if library in map(posixpath.normpath, c.outputs)] or writing
    if not writing:
        return list(calls)
    # A write the script may not make (a branch the reader cannot decide) may be the library's.
    linked, todo = [], [writing[-1]] + [c for c in writing[:-1] if c.condition]
    while todo:
        link = todo.pop()
        linked.append(link)
        if link.opaque:
            return list(calls)
        for path in map(posixpath.normpath, link.objects):
            makers = [c for c in calls[:calls.index(link)] if any(
                fnmatch.fnmatchcase(posixpath.normpath(o), path) for o in c.outputs)]
            if not any(c in path for c in "*?["):
                makers = makers[-1:]  # a file written again is what the last call wrote
            if not makers:
                return list(calls)
            todo.extend(c for c in makers if c not in linked and c not in todo)
    return [c for c in calls if c in linked and (c.inputs or not c.objects)]


# A target flag or value in what is left of a word around the values the reader
# cannot expand: -arch=sm_$A, arch=compute_$A, --offload-arch=$T, gfx$N (not codec2/, search.cu).
TARGET_WORD_RE = re.compile(r"(?:^|[\s,=])-[\w-]*(?:arch|code|mcpu|target)|\b(?:arch|code)=|\b(?:sm|compute)_|\bgfx")


def might_hold_targets(word):
    """Whether a word the reader cannot expand may hold target flags: it is
    nothing but such values (`$FLAGS`), or it names a target flag."""
    text = SH_LABEL_RE.sub("", word)
    return not text or TARGET_WORD_RE.search(text) is not None


def is_compiler_name(word):
    return COMPILER_NAME_RE.match(word.rsplit("/", 1)[-1]) is not None


def looks_like_compiler_arguments(args):
    """Whether the arguments are a compiler's, whatever runs them."""
    for arg in args:
        if arg in ("-gencode", "--generate-code") or arg.startswith(
                ("-gencode=", "--generate-code=", "--offload-arch", "--amdgpu-target", "-arch=sm_",
                 "--gpu-architecture")):
            return True
    return "-shared" in args and any(a == "-o" or a.startswith("-o") for a in args)


def compiler_call(words, line=None, cwd=None, environment=None, options_file=None):
    """The facts of a command whose words (its argv: variables expanded,
    quotes removed) are `words`, or None when it is no compiler call.
    environment: the variables the call sees ({name: value}); options_file
    (path): the text of an options file the call names, None when it cannot
    be told.

    A compiler call's command word, after `VAR=value`, ccache, sccache or
    env, names a compiler (nvcc, hipcc, clang++, gcc-12, ...); a command
    word the reader cannot resolve is one when its arguments are a
    compiler's (-gencode, --offload-arch, -shared with -o).  Targets are
    read as the compilers define them: nvcc `-gencode arch=compute_X,code=
    [sm_X,compute_X]`, `-arch=sm_X` (machine code and PTX for X),
    `-arch=compute_X` (PTX only), `-code=` lists; clang and hipcc
    `--offload-arch=`, `--amdgpu-target=`, `-mcpu=gfxN`, `--genco --targets
    a,b`; `-march=` for the CPU; nvcc's NVCC_PREPEND_FLAGS,
    NVCC_APPEND_FLAGS and -optf files as nvcc reads them.  Words that hold
    NOT_REACHED (they depend on an argument the default invocation does not
    pass) are not read.
    """
    words, environment = list(words), dict(environment or {})
    while words and (ENV_WORD_RE.match(words[0]) or words[0].rsplit("/", 1)[-1] in COMPILER_WRAPPERS):
        if ENV_WORD_RE.match(words[0]):
            environment.__setitem__(*words[0].split("=", 1))
        words = words[1:]
    if not words:
        return None
    command, args = words[0], words[1:]
    if not is_compiler_name(command):
        resolved = not any(marker in command for marker in MARKERS)
        if resolved or not looks_like_compiler_arguments(args):
            return None
    call = CompilerCall(command.rsplit("/", 1)[-1], line)
    row = compiler_row(command)
    args = row.arguments(args, environment)
    arch = code = None
    followed = 0
    genco = "--genco" in args
    call.languages = {value for flag, value in zip(args, args[1:]) if flag in ("-x", "--x")} | {
        arg.split("=", 1)[1] for arg in args if arg.startswith(("-x=", "--x="))}
    modes = {COMPILER_MODES.get(arg) for arg in args}
    index = 0
    while index < len(args):
        arg = args[index]
        index += 1
        if NOT_REACHED in arg:
            continue
        name, equals, value = arg.partition("=")
        kind = COMPILER_OPTIONS.get(name) if arg[:1] == "-" else None
        if name in row.option_files:
            kind = "options"
        elif arg[:1] == "@" and "@" in row.option_files and len(arg) > 1:
            kind, name, equals, value = "options", "@", "@", arg[1:]
        if kind is None:
            if arg.startswith("-D") or (arg.startswith("-o") and not equals and row.joined_output):
                kind, value = ("define" if arg[1] == "D" else "output"), arg[2:]
            elif not known(arg) and might_hold_targets(arg):
                call.unknown.append(show_word(arg))
                call.opaque = True
                continue
            else:
                joined = arg if cwd is None or arg.startswith(("/", OUT_DIR, RUNTIME)) else cwd + "/" + arg
                if arg[:1] != "-" and arg.endswith(COMPILED_SUFFIXES) and args[index - 2:index - 1] not in (
                        ["-include"], ["-imacros"], ["--pre-include"]):  # a file included, not compiled
                    call.inputs.append(joined)  # "$here/k.cu" too: a source, whatever $here is
                elif not known(arg):
                    call.opaque = True
                elif arg[:1] != "-" and arg.endswith(LINKED_SUFFIXES):
                    call.objects.append(joined)
                continue
        elif not equals:
            if kind in ("march", "mcpu"):
                continue
            value = args[index] if index < len(args) else None
            index += 1
            arg += " " + (value or "")
        if value is None or NOT_REACHED in value:
            continue
        if kind == "output":
            if value == "/dev/null":
                call.probes += 1
            else:
                if cwd is not None and not value.startswith(("/", OUT_DIR, RUNTIME)):
                    value = cwd + "/" + value
                call.outputs.append(value)
            continue
        if kind == "mcpu":
            if not value.startswith("gfx"):
                kind = "cpu"
            else:
                kind = "offload"
        if kind == "targets" and not genco:
            continue
        if not known(value):
            call.unknown.append(show_word(arg))
        elif kind == "options":
            for path in value.split(",") if name != "@" else [value]:
                words = None
                if options_file is not None and followed < OPTION_FILE_DEPTH:
                    text = options_file(path if cwd is None or path.startswith("/") else cwd + "/" + path)
                    words = row.option_words(text) if text not in (None, "\x01") else None
                if words is None:
                    call.unknown.append("%s%s, a file of options the checker cannot read"
                                        % (name + " " if name != "@" else "@", show_word(path)))
                    call.opaque = True
                else:
                    followed += 1
                    args[index:index] = words
        elif kind == "gencode":
            gencode(call, value)
        elif kind == "arch" and "," in value:
            call.rejected.append("-arch=%s: nvcc takes one architecture after -arch (a list is an "
                                 "unsupported gpu architecture); write -gencode arch=compute_X,code=sm_X "
                                 "for each" % value)
        elif kind == "arch":
            arch = value
        elif kind == "code":
            code = value
        elif kind in ("offload", "targets"):
            for target in value.split(","):
                if target in OPEN_TARGETS:
                    call.open_targets.append("%s=%s" % (name, target))
                elif target.startswith("sm_"):
                    call.sass.append(target[3:])
                elif target:
                    call.hip.append(target)
        elif kind in ("march", "cpu") and value == "native":
            call.open_targets.append("%s=native" % name)  # the machine it runs on
        elif kind == "march":
            call.march.append(value)
        elif kind == "cpu":
            call.mcpu.append(value)
        elif kind == "define":
            define = ABI_DEFINE_FLAG_RE.match(value)
            if define:
                call.abi_defines.append((define.group(1), define.group(2)))
    if code is not None:
        virtual = cuda_target(call, arch, "-arch=%s" % arch) if arch is not None else None
        if virtual is not None and virtual[0] == "sm":
            call.rejected.append("-arch=%s with -code: nvcc takes a virtual architecture there; "
                                 "write -arch=compute_%s" % (arch, virtual[1]))
        cuda_codes(call, code.split(","), "-code=" + code, virtual)
    elif arch in OPEN_TARGETS:
        call.open_targets.append("-arch=" + arch)
    elif arch is not None:
        item = cuda_target(call, arch, "-arch=" + arch)
        if item is not None:
            call.ptx.append(item[1])
            if item[0] == "sm":
                call.sass.append(item[1])
    places = call.inputs + call.outputs + call.objects + ([cwd + "/"] if cwd else [])
    if any(PROBE_PLACE_RE.search(place) for place in places):
        call.inputs, call.outputs, call.objects, call.abi_defines, call.rejected = [], [], [], [], []
        call.probes += 1
    call.unknown = [show_word(u) for u in call.unknown]  # as messages show them: $1, not a marker
    call.rejected = [show_word(r) for r in call.rejected]
    if "probe" in modes or (call.probes and not call.outputs) or call.rejected:  # nothing built
        call.sass, call.ptx, call.hip, call.march, call.mcpu, call.inputs = [], [], [], [], [], []
    elif "ptx" in modes:
        call.ptx, call.sass = call.ptx + [t for t in call.sass if t not in call.ptx], []
    return call


def gencode(call, value):
    """Read one nvcc -gencode value into the call's targets."""
    match = GENCODE_RE.match(value)
    if match is None:
        call.unknown.append("-gencode %s, which nvcc does not read (a list of codes is written "
                            "code=[sm_80,sm_90])" % value)
        return
    flag = "-gencode " + value
    virtual = cuda_target(call, match.group(1), flag)
    if virtual is not None and virtual[0] == "sm":
        call.rejected.append("%s: nvcc takes a virtual architecture after arch=; write "
                             "arch=compute_%s" % (flag, virtual[1]))
    cuda_codes(call, match.group(2).strip('[]"').split(","), flag, virtual)


def cuda_target(call, item, flag):
    """(sm or compute, number) of an nvcc target name; None for a name nvcc
    rejects (noted with its right spelling) or does not know."""
    target = CUDA_CODE_ITEM_RE.match(item.strip())
    if target is not None:
        return target.groups()
    typo = CUDA_TARGET_TYPO_RE.match(item.strip())
    if typo is not None:
        call.rejected.append("%s: nvcc knows no target %s; write %s_%s"
                             % (flag, item.strip(), typo.group(1), typo.group(2)))
    else:
        call.unknown.append("%s, whose code %s nvcc does not read" % (flag, item))
    return None


def cuda_codes(call, codes, flag, virtual=None):
    """The codes of -gencode code=... or -code=..., each checked against the
    virtual architecture it is generated from."""
    for item in codes:
        code = cuda_target(call, item, flag)
        if code is None:
            continue
        refused = virtual is not None and virtual[0] == "compute" and nvcc_refuses(virtual[1], code)
        if refused:
            call.rejected.append("%s: nvcc refuses it (incompatible code generation: %s_%s cannot "
                                 "be built from compute_%s); write %s" % (flag, code[0], code[1],
                                                                         virtual[1], refused))
        elif code[0] == "sm":
            call.sass.append(code[1])
        else:
            call.ptx.append(code[1])


def nvcc_refuses(virtual, code):
    """The spelling nvcc takes, when it refuses to generate `code` (sm or
    compute, number) from compute_<virtual>; None when it generates it.
    As nvcc 13 does: PTX only of its own architecture; machine code of the
    same number or higher, of an arch-specific (a) architecture only
    arch-specific, of a family (f) one only in that family."""
    kind, target = code
    number, base = int(DIGITS_RE.match(target).group()), int(DIGITS_RE.match(virtual).group())
    if kind == "compute":
        ok = target == virtual
    else:
        ok = number >= base and (not virtual.endswith("a") or target.endswith("a")) and (
            not virtual.endswith("f") or number // 10 == base // 10)
    return None if ok else "arch=compute_%s,code=%s_%s" % (target, kind, target)


class ScriptFacts:
    """What a build script's default invocation does: its compiler calls in
    order, the target it takes when no <arch> is given (`${2:-N}`), the
    constructs met that the reader does not follow, as (line, what), and
    what it puts into <output-dir> or takes out of it, in order, as (op,
    path relative to <output-dir> or None when the name cannot be told,
    line, condition): op "add" (a compiler's -o, cp, mv, ln) or "remove"
    (mv out of it, rm; the path may be a glob, "" for the whole directory)."""

    __slots__ = ("calls", "default_target", "unfollowed", "out_dir", "placements", "death", "dangling",
                 "failures", "programs", "script_dirs", "made_directory")

    def __init__(self, calls, default_target=None, unfollowed=(), out_dir=OUT_DIR, placements=None,
                 death=None):
        self.calls = calls
        self.death = death  # (line, why) where the default invocation surely fails
        self.dangling = {}  # {file in <output-dir>: what it links to}, for links that dangle
        self.failures = []  # (line, why) of commands that surely fail, the script going on
        self.programs = set()  # the lines of the unfollowed that are programs (make), not shell text
        self.script_dirs = {}  # {value: place}: values naming the script's directory (script_place())
        self.made_directory = False  # whether mkdir made a directory other than <output-dir>
        self.default_target = default_target
        self.unfollowed = list(unfollowed)
        self.out_dir = out_dir  # the <output-dir> argument, as the outputs spell it
        if placements is None:
            prefix = out_dir + "/"
            placements = [("add", posixpath.normpath(o[len(prefix):]), c.line, None)
                          for c in calls for o in c.outputs if o.startswith(prefix)]
        self.placements = placements

    def library(self, output):
        """The path of build.output as the calls' outputs spell it."""
        return self.out_dir + "/" + posixpath.normpath(output) if isinstance(output, str) else None

    def landing(self):
        """(the files surely in <output-dir> when the script ends, {file or
        None: why it may or may not be there})."""
        landed, maybe = set(), {}
        for op, path, line, condition in self.placements:
            if path is None:
                maybe[None] = "line %d puts a file there whose name the checker cannot tell" % line
            elif op == "add":
                landed.add(path)
            else:
                gone = {p for p in landed if not path or p.startswith(path + "/")
                        or fnmatch.fnmatchcase(p, path)}
                landed -= gone
                if condition:
                    maybe.update((p, "line %d moves or removes it, depending on %s" % (line, condition))
                                 for p in gone)
        return landed, maybe


def script_place(script_dirs, path):
    """A path that starts with a value naming the script's directory (a
    ScriptReader's script_dirs), as a path relative to that directory
    (not normalized: a link's .. is not the path's); else None."""
    for value, place in script_dirs.items():
        rest = path[len(value):]
        if path.startswith(value) and rest[:1] in ("", "/") and not any(m in rest for m in MARKERS):
            return "." + place + rest
    return None


def show_word(word):
    """A word as a message shows it: $1 for the output directory, the source
    text of what the reader cannot know."""
    word = SH_LABEL_RE.sub(r"\1", word)
    return word.replace(OUT_DIR, "$1").replace(NOT_REACHED, "$2")


def show_path(path):
    """An output path as a message shows it, saying where a relative one is."""
    if path.startswith(("/", OUT_DIR, RUNTIME, UNDECIDED)):
        return show_word(path)
    return "%s (relative to the directory the script is run from)" % show_word(path)


def check_build_facts(backend, rel, facts, traced=False):
    """B004-B007, B009, B011, B013, B016, B017: compare what the build script
    `rel` does (its ScriptFacts, read or traced) with the manifest.  Where
    the answer depends on what the reader cannot tell, B017 says so instead
    of an error.  Findings from a trace (`traced`) say so."""
    said = "running %s shows: " % rel if traced else ""
    where = backend.rel(rel)
    unfollowed = ""
    if facts.unfollowed:
        unfollowed = "; the checker does not follow %s" % ", ".join(
            "line %d (%s)" % (line, what) for line, what in facts.unfollowed)
    outputs = [(output, call) for call in facts.calls for output in call.outputs]
    start = len(backend.diagnostics)
    if facts.death:
        line, why = facts.death
        backend.error("B019", "%s%s <output-dir> fails at line %d: %s%s" % (
            said, rel, line, why, "" if outputs else ", before any compiler command with -o; "
            "the build tier and CI would fail there"), where, line)
        if not outputs:
            return
    for line, why in facts.failures[:1]:
        backend.error("B019", "%s%s <output-dir> fails at line %d: %s" % (said, rel, line, why),
                      where, line)
    warned = len(backend.diagnostics)
    if not outputs:
        if facts.unfollowed:
            backend.warning("B017", "%scannot tell which library %s writes: it has no compiler "
                            "command with -o that the checker can see%s"
                            % (said, rel, unfollowed), where, facts.unfollowed[0][0])
        else:
            backend.error("B005", "%sbuild script %s has no compiler command with -o; the script "
                          "must write build.output into its <output-dir> argument" % (said, rel),
                          where)
        return
    prefix = facts.out_dir + "/"
    landed, maybe = facts.landing()
    output, call = outputs[-1]
    library = posixpath.normpath(backend.output) if backend.output is not None else None
    if library in facts.dangling:
        link = show_word(facts.dangling[library])
        backend.error("B013", "%s%s leaves %s in <output-dir> as a link to %s, which is not there "
                      "when the script ends%s; link to a file in <output-dir>, or copy the library "
                      "there" % (said, rel, library, link, "" if link.startswith(("/", "$", "<", "~"))
                                 else " (a relative link is read from the directory it is in, "
                                 "<output-dir>)"), where)
    elif library is not None and library not in landed:
        why = maybe.get(library) or maybe.get(None)
        if why:
            backend.warning("B017", "%scannot tell whether %s is in <output-dir> when %s ends: %s"
                            % (said, library, rel, why), where)
        elif call.condition or UNDECIDED in output:
            backend.warning("B017", "%scannot tell which library %s writes: -o %s at line %d %s"
                            % (said, rel, show_word(output), call.line,
                               "depends on " + call.condition if call.condition else
                               "depends on a value the checker cannot decide"), where, call.line)
        elif output.startswith(prefix) and posixpath.normpath(output[len(prefix):]) == library:
            backend.error("B013", "%sbuild script %s writes %s with -o, but it is not in <output-dir> "
                          "when the script ends (moved or removed after); leave build.output there"
                          % (said, rel, library), where, call.line)
        elif output.startswith(prefix):
            backend.error("B004", "%sbuild script %s writes %s but build.output is %s"
                          % (said, rel, describe(show_word(output[len(prefix):])),
                             describe(backend.output)), where, call.line)
        else:
            backend.error("B013", "%sbuild script %s writes its library to %s, not under its "
                          "<output-dir> argument ($1): the build tier and CI look for %s in "
                          "<output-dir>; write -o \"$1/%s\""
                          % (said, rel, show_path(output), backend.output, backend.output),
                          where, call.line)
    check_build_defines(backend, rel, facts, said, where)
    for call in facts.calls:
        for why in call.rejected:
            backend.error("B018", "%s%s builds with %s" % (said, rel, why), where, call.line)
    if backend.architectures is not None:
        check_built_targets(backend, rel, facts, said, where, unfollowed)
    default = backend.default_arch
    if default is not None and facts.default_target is not None and facts.default_target != default:
        backend.error("B009", "%sbuild.default_arch is %s but %s defaults its target to %s "
                      "(${2:-%s})" % (said, default, rel, facts.default_target,
                                      facts.default_target), where)
    # What it does not follow may change what it reads (eval, a file it sources) or, after
    # the library is written, replace or remove it; a program before it (make) does neither.
    late = [(line, what) for line, what in facts.unfollowed
            if line is None or line >= call.line or line not in facts.programs]
    if any(line not in facts.programs for line, _ in facts.unfollowed) and not traced:
        # eval, a file it cannot source: what runs may not be what it read; no error is sure.
        backend.diagnostics[start:] = [d for d in backend.diagnostics[start:] if d.level != "error"]
    if late and "B017" not in [d.code for d in backend.diagnostics[warned:]]:
        backend.warning("B017", "%scannot tell whether %s builds only what the checker reads; the "
                        "checker does not follow %s" % (said, rel, ", ".join(
                            "line %d (%s)" % item for item in late)), where, late[0][0])


def check_built_targets(backend, rel, facts, said, where, unfollowed):
    """B006, B007, B011 and B017 for build.architectures."""
    platform = backend.platform
    built, maybe, ptx, unknown = {}, set(), set(), []
    # A target not built points at the call that writes the library; one the
    # reader cannot tell of, at the first place it cannot tell.
    writes = [call.line for call in facts.calls if call.outputs][-1:]
    unsure = []
    for call in linked_calls(facts.calls, facts.library(backend.output)):
        for arch in call.targets(platform):
            if call.condition:
                maybe.add(arch)
            else:
                built.setdefault(arch, call.line)
        ptx.update(call.ptx)
        unknown.extend(what + (" at line %d" % call.line if call.line else "")
                       for what in call.unknown)
        default = call.names_no_target(platform)
        if default:
            unknown.append("%s%s names no target, so it builds its compiler's default, which depends "
                           "on the compiler's version and the machine (name each target with a flag)"
                           % (call.compiler, " at line %d" % call.line if call.line else ""))
        if call.unknown or call.condition or default:
            unsure.append(call.line)
        if call.condition:
            unknown.append("a compiler command at line %d that runs only on %s"
                           % (call.line, call.condition))
        for flag in call.open_targets:
            backend.error("B011", "%s%s builds with %s, which is no fixed list of targets (it "
                          "depends on the compiler's version or the machine it runs on); list the "
                          "targets, one flag each" % (said, rel, flag), where, call.line)
    for arch in backend.architectures:
        if arch in built:
            continue
        if arch in maybe or unknown or facts.unfollowed:
            line = (unsure + [line for line, _ in facts.unfollowed] + writes + [None])[0]
            backend.warning("B017", "%scannot tell whether %s builds %s: %s%s"
                            % (said, rel, arch, "; ".join(unknown) or "no target flag names it",
                               unfollowed), where, line)
        elif platform == "cuda" and arch in ptx:
            backend.error("B006", "%sbuild.architectures lists %s but %s builds only PTX for it "
                          "(compute_%s), which is compiled when the library is loaded, not machine "
                          "code; add code=sm_%s" % (said, arch, rel, arch, arch), where,
                          (writes + [None])[0])
        else:
            backend.error("B006", "%sbuild.architectures lists %s but the default invocation of "
                          "%s does not build it" % (said, arch, rel), where, (writes + [None])[0])
    for arch in sorted(built):
        if arch not in backend.architectures:
            backend.error("B007", "%s%s also builds %s, which build.architectures does not list; "
                          "list it (the build tier rejects a library with targets the manifest does "
                          "not name, R008)" % (said, rel, arch), where, built[arch])


def check_compiled_sources(repo, backend, calls, repository_path, traced=False, complete=True,
                           made=lambda path: False):
    """S008, S009: what the compiler calls (CompilerCall, run or read)
    compiled, against `sources`.  repository_path(path) gives a compiled
    path's place relative to the repository root, or None outside it; a
    file the repository does not hold was made by the build, not declared,
    or, when it is not there after the run either, is no file at all (the
    real compiler fails on it; made(path) says whether the build made it).
    Without `complete` (a compiler the calls may miss), a declared source
    no call compiles is not reported."""
    said = "running %s shows: " % backend.build_script if traced else ""
    prefix = backend.rel_dir + "/"
    declared = {rel for _, rel, problem in backend.sources if rel and not problem}
    excluded = backend.manifest.get("excluded")
    excluded = [g for g in excluded if isinstance(g, str)] if isinstance(excluded, list) else []
    compiled, reported = set(), set()
    for call in calls:
        for path in call.inputs:
            rel = repository_path(posixpath.normpath(path))
            if rel is None or rel in reported:
                continue
            local = rel[len(prefix):] if rel.startswith(prefix) else None
            if not os.path.isfile(os.path.join(repo.root, rel)):
                # In the backend directory, not declared (else S001 says so), not made by the run.
                if local is not None and local not in declared and not made(path):
                    reported.add(rel)
                    backend.error("S008", "%s%s compiles %s, which is no file (%s), so the real "
                                  "compiler fails on it; correct the name, or add the file to %s and "
                                  "declare it" % (said, backend.build_script, rel, "neither the "
                                                  "repository nor the build has it" if traced else
                                                  "the repository does not have it, and nothing the "
                                                  "script runs before makes files", backend.rel_dir),
                                  rel, call.line)
                continue
            compiled.add(local)
            if local in declared:
                continue
            reported.add(rel)
            if local is None:
                why = ("outside the backend directory, where the check does not look; move it into "
                       "%s, or build it as a backend of its own" % backend.rel_dir)
            elif any(glob_matches(g, local) for g in excluded):
                why = "which excluded says is not part of the library; remove it from excluded and declare it"
            else:
                why = "which sources does not declare; add it"
            backend.error("S008", "%s%s compiles %s, %s" % (said, backend.build_script, rel, why),
                          rel, call.line)
    for local in sorted(declared) if complete and compiled else ():
        if local.endswith(COMPILED_SUFFIXES) and local not in compiled:
            backend.warning("S009", "%ssources declares %s, but no compiler call of %s compiles it "
                            "(a file only #included by another is a header: name it so, or list it "
                            "in excluded)" % (said, local, backend.build_script), backend.rel(local))


def check_build_defines(backend, rel, facts, said, where):
    """B016: a -D<PREFIX>_ABI_VERSION=N that differs from abi_version."""
    if not is_int(backend.abi_version):
        return
    for call in facts.calls:
        for prefix, value in call.abi_defines:
            if value.strip() != str(backend.abi_version):
                backend.error("B016", "%s%s compiles with -D%s_ABI_VERSION=%s but abi_version is "
                              "%d; the library would report another ABI version than the manifest"
                              % (said, rel, prefix, show_word(value), backend.abi_version),
                              where, call.line)


# ---------------------------------------------------------------------------
# Reading build scripts (as text; never executed)
#
# One pass per script: the text is split into tokens, the tokens into a tree
# of shell commands, and the tree is followed the way the default invocation
# `./build.sh <output-dir>` runs it (no <arch>, no optional environment
# variable set).  A condition the default invocation decides picks its
# branch; one it does not (a file test, a command's output) runs every
# branch, and a variable they set differently is UNDECIDED afterwards.  What
# the reader does not follow (eval, a loop it cannot bound, a file sourced
# from elsewhere) is recorded, so that a check that needs it says it cannot
# tell instead of giving a wrong answer.


class ShellSyntax(Exception):
    """Shell text the reader does not parse; args: (line, what)."""


class ScriptExit(Exception):
    """The script exits here (exit, or every branch of a condition does);
    args: (status,), True, False or None (cannot tell)."""

    @property
    def status(self):
        return self.args[0] if self.args else None


class FunctionReturn(Exception):
    """return: the function ends; args: (status,) as ScriptExit's."""

    status = ScriptExit.status


class LoopBreak(Exception):
    pass


class LoopContinue(Exception):
    pass




def runtime(label):
    """A value computed when the script runs, shown as `label`."""
    return RUNTIME + SH_LABEL_RE.sub(r"\1", label)[:120] + RUNTIME


def undecided(label):
    """A value the reader cannot decide, shown as `label`."""
    return UNDECIDED + SH_LABEL_RE.sub(r"\1", label)[:160] + UNDECIDED


def known(value):
    """Whether a value holds nothing the reader cannot know."""
    return RUNTIME not in value and UNDECIDED not in value


# -- tokens


def scan_balanced(text, pos, close):
    """The index after the `close` that ends a $(, ${ or ` opened before
    `pos`, quotes and nested openings respected; len(text) when none does."""
    depth = 1
    length = len(text)
    while pos < length:
        char = text[pos]
        if char == "\\":
            pos += 2
            continue
        if close == "`":
            if char == "`":
                return pos + 1
        elif char == "'" and close == ")":
            end = text.find("'", pos + 1)
            pos = length if end < 0 else end + 1
            continue
        elif char == '"':
            pos = scan_double(text, pos + 1)
            continue
        elif char == "`":
            pos = scan_balanced(text, pos + 1, "`")
            continue
        elif char == ("(" if close == ")" else "{"):
            depth += 1
        elif char == close:
            depth -= 1
            if depth == 0:
                return pos + 1
        pos += 1
    return length


def scan_double(text, pos):
    """The index after the `"` that closes a double-quoted string begun before `pos`."""
    length = len(text)
    while pos < length:
        plain = SH_DOUBLE_PLAIN_RE.match(text, pos)
        if plain:
            pos = plain.end()
            continue
        char = text[pos]
        if char == '"':
            return pos + 1
        if char == "\\":
            pos += 2
        elif char == "`":
            pos = scan_balanced(text, pos + 1, "`")
        elif text.startswith("$(", pos):
            pos = scan_balanced(text, pos + 2, ")")
        elif text.startswith("${", pos):
            pos = scan_balanced(text, pos + 2, "}")
        else:
            pos += 1
    return length


def scan_word(text, pos):
    """The index where the word starting at `pos` ends."""
    length = len(text)
    start = pos
    while pos < length:
        plain = SH_PLAIN_RE.match(text, pos)
        if plain:
            pos = plain.end()
            continue
        char = text[pos]
        if char == "'":
            end = text.find("'", pos + 1)
            pos = length if end < 0 else end + 1
        elif char == '"':
            pos = scan_double(text, pos + 1)
        elif char == "\\":
            pos += 2
        elif char == "`":
            pos = scan_balanced(text, pos + 1, "`")
        elif text.startswith("$(", pos):
            pos = scan_balanced(text, pos + 2, ")")
        elif text.startswith("${", pos):
            pos = scan_balanced(text, pos + 2, "}")
        elif text.startswith("$'", pos):
            end = pos + 2
            while end < length and text[end] != "'":
                end += 2 if text[end] == "\\" else 1
            pos = end + 1
        elif char == "$":
            pos += 1
        elif char == "(" and pos > start and SH_ASSIGNMENT_RE.match(text, start, pos) and text[pos - 1] == "=":
            pos = scan_array(text, pos + 1)  # name=( ... )
        else:
            break
    return min(pos, length)


def scan_array(text, pos):
    """The index after the `)` that closes an array value begun before `pos`."""
    length = len(text)
    while pos < length:
        token = SH_TOKEN_RE.match(text, pos)
        if token and token.group("op") == ")":
            return pos + 1
        if token and token.lastgroup in ("blank", "comment", "newline"):
            pos = token.end()
            continue
        end = scan_word(text, pos)
        pos = end if end > pos else pos + 1
    return length


def tokenize(text):
    """The script's tokens as (kind, text, line): kind "word", "op" or "newline".
    Here-document bodies are skipped."""
    tokens = []
    line = 1
    heredocs = []  # (delimiter, strip tabs) waiting for the end of the line
    pos = 0
    while pos < len(text):  # SH_TOKEN_RE matches at every position (other: any character)
        if text.startswith(("<(", ">("), pos):  # a process substitution is a word
            end = scan_balanced(text, pos + 2, ")")
            tokens.append(("word", text[pos:end], line))
            line += text.count("\n", pos, end)
            pos = end
            continue
        match = SH_TOKEN_RE.match(text, pos)
        pos = match.end()
        kind = match.lastgroup
        if kind == "word" or kind == "other":
            start = end = match.end()
            if kind == "other" or text.startswith(SH_WORD_GOES_ON, end) or (
                    text.startswith("(", end) and text[end - 1] == "="):
                start = match.start()
                end = max(scan_word(text, start), start + 1)  # $(...), `...`, name=(...)
            word = text[match.start():end]
            if tokens and tokens[-1][0] == "op" and tokens[-1][1].lstrip("0123456789") in ("<<", "<<-"):
                heredocs.append((re.sub(r"[\"'\\]", "", word), tokens[-1][1].endswith("-")))
            tokens.append(("word", word, line))
            line += word.count("\n")
            pos = end
        elif kind == "newline":
            tokens.append(("newline", "\n", line))
            line += 1
            if heredocs:
                pos = match.end()
                for delimiter, strip in heredocs:
                    while pos < len(text):
                        end = text.find("\n", pos)
                        end = len(text) if end < 0 else end
                        body = text[pos:end]
                        pos = end + 1
                        line += 1
                        if (body.lstrip("\t") if strip else body) == delimiter:
                            break
                heredocs = []
        elif kind == "op":
            tokens.append(("op", match.group(), line))
        elif kind == "blank" and "\n" in match.group():
            line += match.group().count("\n")
    tokens.append(("newline", "\n", line))
    return tokens


# -- the tree of commands: named nodes, each with the line it starts at; a
# body or a condition is a list of them.

Simple = collections.namedtuple("Simple", "line words")
If = collections.namedtuple("If", "line clauses otherwise")  # [(condition, body)], a body or None
Case = collections.namedtuple("Case", "line word items")  # [(patterns, body, ";;", ";&" or ";;&")]
Arithmetic = collections.namedtuple("Arithmetic", "line expression")  # (( expression ))
For = collections.namedtuple("For", "line name words body")  # words None: "$@"
ArithmeticFor = collections.namedtuple("ArithmeticFor", "line expression body")  # for ((a; b; c))
While = collections.namedtuple("While", "line until condition body")
Function = collections.namedtuple("Function", "line name body")
Group = collections.namedtuple("Group", "line body subshell")  # ( body ) or { body; }
AndOr = collections.namedtuple("AndOr", "line first rest")  # rest: [("&&" or "||", pipeline)]
Pipeline = collections.namedtuple("Pipeline", "line negated commands")
# A function defined differently on the branches of a condition the reader
# cannot decide: each definition (None where it is not defined).
Choice = collections.namedtuple("Choice", "label bodies")


class ScriptParser:
    def __init__(self, text):
        self.tokens = tokenize(text)
        self.pos = 0
        self.writes = set()  # the lines of commands that write a file by redirection (> gen.cu)

    def peek(self):
        return self.tokens[self.pos]

    def next(self):
        token = self.tokens[self.pos]
        if self.pos < len(self.tokens) - 1:
            self.pos += 1
        return token

    def at_end(self):
        return self.pos >= len(self.tokens) - 1

    def is_word(self, *words):
        kind, text, _ = self.peek()
        return kind == "word" and text in words

    def expect_word(self, word):
        kind, text, line = self.next()
        if kind != "word" or text != word:
            raise ShellSyntax(line, "%s where %s was expected" % (text.strip() or "the end", word))

    def skip_newlines(self):
        while self.peek()[0] == "newline" and not self.at_end():
            self.next()

    def parse(self):
        body = self.parse_list(())
        if not self.at_end():
            raise ShellSyntax(self.peek()[2], "%s out of place" % self.peek()[1])
        return body

    def parse_list(self, stop):
        """Commands up to a word in `stop` (then, fi, done...) or `)`, `;;`."""
        body = []
        while True:
            self.skip_newlines()
            kind, text, line = self.peek()
            if self.at_end() or (kind == "word" and text in stop) or (
                    kind == "op" and text in (")", ";;", ";&", ";;&")):
                return body
            body.append(self.parse_andor())
            kind, text, _ = self.peek()
            if kind == "op" and text in (";", "&"):
                self.next()
            elif kind != "newline" and not (kind == "word" and text in stop) and not (
                    kind == "op" and text in (")", ";;", ";&", ";;&")):
                raise ShellSyntax(line, "%s out of place" % text)

    def parse_andor(self):
        line = self.peek()[2]
        first = self.parse_pipeline()
        rest = []
        while self.peek()[0] == "op" and self.peek()[1] in ("&&", "||"):
            op = self.next()[1]
            self.skip_newlines()
            rest.append((op, self.parse_pipeline()))
        return AndOr(line, first, rest) if rest else first

    def parse_pipeline(self):
        line = self.peek()[2]
        negated = self.is_word("!")
        if negated:
            self.next()
        commands = [self.parse_command()]
        while self.peek()[0] == "op" and self.peek()[1] in ("|", "|&"):
            self.next()
            self.skip_newlines()
            commands.append(self.parse_command())
        if negated or len(commands) > 1:
            return Pipeline(line, negated, commands)
        return commands[0]

    def parse_command(self):
        kind, text, line = self.peek()
        if kind == "op" and text == "(" and self.tokens[self.pos + 1][:2] == ("op", "("):
            arithmetic = self.parse_arithmetic()
            if arithmetic is not None:
                return arithmetic
        if kind == "op" and text == "(":
            self.next()
            body = self.parse_list(())
            self.expect_op(")")
            return self.redirected(Group(line, body, True))
        if kind != "word":
            raise ShellSyntax(line, "%s out of place" % text.strip())
        if text == "if":
            return self.redirected(self.parse_if())
        if text in ("while", "until"):
            self.next()
            condition = self.parse_list(("do",))
            body = self.parse_do()
            return self.redirected(While(line, text == "until", condition, body))
        if text in ("for", "select"):
            return self.redirected(self.parse_for())
        if text == "case":
            return self.redirected(self.parse_case())
        if text == "{":
            self.next()
            body = self.parse_list(("}",))
            self.expect_word("}")
            return self.redirected(Group(line, body, False))
        if text == "function":
            self.next()
            name = self.next()[1]
            if self.peek()[:2] == ("op", "("):
                self.next()
                self.expect_op(")")
            self.skip_newlines()
            return Function(line, name, self.parse_command())
        if text in SH_RESERVED:
            raise ShellSyntax(line, "%s out of place" % text)
        after = self.tokens[self.pos + 1] if self.pos + 1 < len(self.tokens) else None
        if after is not None and after[:2] == ("op", "(") and SH_FUNCTION_NAME_RE.match(text):
            self.next()
            self.next()
            self.expect_op(")")
            self.skip_newlines()
            return Function(line, text, self.parse_command())
        return self.parse_simple()

    def parse_arithmetic(self, separators=(";",)):
        """(( expression )), or None (and nothing taken) when the text is
        two subshells instead: ( (cd x; make) )."""
        start, line, depth, words = self.pos, self.peek()[2], 0, []
        self.pos += 2
        while not self.at_end():
            kind, text, _ = self.next()
            if kind == "newline" or text in separators:
                break
            if (kind, text, depth) == ("op", ")", 0) and self.peek()[:2] == ("op", ")"):
                self.next()
                return self.redirected(Arithmetic(line, " ".join(words)))
            depth += {"(": 1, ")": -1}.get(text, 0) if kind == "op" else 0
            words.append(text)
        self.pos = start
        return None

    def expect_op(self, op):
        kind, text, line = self.next()
        if kind != "op" or text != op:
            raise ShellSyntax(line, "%s where %s was expected" % (text.strip() or "the end", op))

    def redirected(self, node):
        """A compound command with its redirections (which change nothing read here)."""
        while self.peek()[0] == "op" and SH_REDIRECTS.match(self.peek()[1]):
            self.redirect_target(self.next()[1], node.line)
        return node

    def redirect_target(self, op, start):
        kind, text, line = self.peek()
        if kind != "word":
            return
        self.next()
        if text.startswith(("<(", ">(")) or ">" in op and text not in SH_NO_FILES and not (
                op.endswith("&") and (text.isdigit() or text == "-")):
            self.writes.add(start)
        if text.startswith(("<(", ">(")) and runs_compiler(text[2:-1]):
            raise ShellSyntax(line, "a compiler run inside %s" % text[:60])

    def parse_simple(self):
        line = self.peek()[2]
        words = []
        while True:
            kind, text, _ = self.peek()
            if kind == "word":
                words.append(self.next()[1])
                if text.startswith(("<(", ">(")):
                    self.writes.add(line)
            elif kind == "op" and SH_REDIRECTS.match(text):
                self.redirect_target(self.next()[1], line)
            else:
                return Simple(line, words)

    def parse_if(self):
        line = self.next()[2]
        clauses = []
        while True:
            condition = self.parse_list(("then",))
            self.expect_word("then")
            body = self.parse_list(("elif", "else", "fi"))
            clauses.append((condition, body))
            word = self.next()
            if word[1] == "elif":
                continue
            otherwise = None
            if word[1] == "else":
                otherwise = self.parse_list(("fi",))
                self.expect_word("fi")
            elif word[1] != "fi":
                raise ShellSyntax(word[2], "an if without its fi")
            return If(line, clauses, otherwise)

    def parse_do(self):
        self.skip_newlines()
        self.expect_word("do")
        body = self.parse_list(("done",))
        self.expect_word("done")
        return body

    def parse_for(self):
        line = self.next()[2]
        if self.peek()[:2] == ("op", "(") and self.tokens[self.pos + 1][:2] == ("op", "("):
            loop = self.parse_arithmetic(separators=())
            if loop is None:
                raise ShellSyntax(line, "a for (( )) loop the checker does not read")
            if self.peek()[:2] == ("op", ";"):
                self.next()
            return ArithmeticFor(line, loop.expression, self.parse_do())
        kind, name, _ = self.next()
        if kind != "word" or not SH_NAME_RE.match(name):
            raise ShellSyntax(line, "a for loop the checker does not read (for %s)" % name)
        words = None
        self.skip_newlines()
        if self.is_word("in"):
            self.next()
            words = []
            while self.peek()[0] == "word":
                words.append(self.next()[1])
        if self.peek()[0] == "op" and self.peek()[1] == ";":
            self.next()
        return For(line, name, words, self.parse_do())

    def parse_case(self):
        line = self.next()[2]
        word = self.next()[1]
        self.skip_newlines()
        self.expect_word("in")
        items = []
        while True:
            self.skip_newlines()
            if self.is_word("esac"):
                self.next()
                return Case(line, word, items)
            if self.peek()[:2] == ("op", "("):
                self.next()
            patterns = []
            while True:
                kind, text, at = self.next()
                if kind != "word":
                    raise ShellSyntax(at, "a case pattern the checker does not read")
                patterns.append(text)
                kind, text, at = self.next()
                if (kind, text) == ("op", ")"):
                    break
                if (kind, text) != ("op", "|"):
                    raise ShellSyntax(at, "a case pattern the checker does not read")
            body = self.parse_list(("esac",))
            end = ";;"
            if self.peek()[0] == "op" and self.peek()[1] in (";;", ";&", ";;&"):
                end = self.next()[1]
            items.append((patterns, body, end))


# -- following the default invocation


class ScriptReader:
    """What a build script's default invocation (`./script <output-dir>`)
    runs: its compiler calls (CompilerCall, in order), the target it takes
    from `${2:-N}`, and what it does that the reader does not follow.

    `directory` is the backend directory, where sourced files are read, and
    `script_dir` the script's directory in it ("" for the backend directory;
    None for a script that is a link, whose realpath "$0" is elsewhere).
    """

    def __init__(self, text, directory=None, script_dir=""):
        self.directory = directory
        self.script_dir = script_dir
        self.vars = {}
        self.arrays = {}
        self.args = [OUT_DIR]    # the positional parameters $1, $2, ...
        self.origin = 0          # how far they were shifted; None once set anew
        self.cwd = None          # None: the directory the script is run from
        self.dirs = []           # pushd's stack
        self.functions = {}
        # Shell options (errexit, nounset, lastpipe, expand_aliases: True,
        # or UNDECIDED where branches set them differently), aliases, traps.
        self.options = {"expand_aliases": True} if POSIX_SHEBANG_RE.match(text) else {}
        self.aliases = {}
        self.traps = {}
        self.links = {}          # {path in <output-dir>: (link text, line)} of ln -s
        self.removed = {}        # {path elsewhere: line} that rm or mv took away
        errexit = SHEBANG_OPTIONS_RE.match(text)
        if errexit:
            self.options.update((OPTION_LETTERS[c], True) for c in errexit.group(1) if c in OPTION_LETTERS)
        self.quiet = 0           # > 0 where a failure does not stop the script (if's condition, a || b)
        self.subshells = 0
        self.death = None        # (line, why): where the default invocation surely fails
        self.failures = []       # (line, why) of commands that surely fail, the script going on
        self.programs = set()    # the lines of programs it does not read, which change no variable
        self.unsure = False      # a variable may be set where the reader does not see it
        self.trail = []          # (table, name, value before): every change, for either()
        self.frames = []         # per function call: {name: value before `local`}
        self.calls = []
        # The directory of the script ($0 as the checker and the build tier run it:
        # its absolute path, links unresolved): {value naming it: path from it}.
        self.script_paths = set(map(runtime, SH_SCRIPT_PATHS if BASH_SHEBANG_RE.match(text) else ["$0"]))
        self.script_dirs = {}
        self.wrote = False       # whether a command run so far may have written a file
        self.made_directory = False  # whether mkdir made a directory other than <output-dir>
        self.writes = set()      # the lines of the commands that write by redirection
        self.placements = []     # ScriptFacts.placements
        self.unfollowed = []     # (line, what)
        self.arg2_defaults = []
        self.condition = None    # why the commands being read may not run
        self.line = None         # the line a sourced file's commands are reported at
        self.at = 1              # the line of the command being read
        self.steps = 0
        self.depth = 0
        self.sourced = []        # the sourced files whose text runs, innermost last (None: the script's)
        self.defined_in = {}     # {function: the sourced file defining it, None for the script}
        try:
            parser = ScriptParser(text)
            tree = parser.parse()
            self.writes = parser.writes
        except ShellSyntax as problem:
            self.unfollowed.append(problem.args)
            return
        except RecursionError:
            self.unfollowed.append((1, "shell text nested deeper than it reads"))
            return
        try:
            try:
                self.run_list(tree)
            except (ScriptExit, FunctionReturn, LoopBreak, LoopContinue):
                pass
            self.run_exit_trap()
        except RecursionError:
            self.unfollowed.append((1, "shell text nested deeper than it reads"))

    def facts(self):
        facts = ScriptFacts(self.calls, self.default_target(), self.unfollowed,
                            placements=self.placements, death=self.death)
        facts.failures = self.failures
        facts.programs = self.programs
        facts.script_dirs = self.script_dirs
        facts.made_directory = self.made_directory
        facts.dangling = self.dangling(facts.landing()[0])
        return facts

    def run_exit_trap(self):
        """What `trap CMD EXIT` set runs when the script (or a subshell) ends."""
        command = self.traps.get("EXIT")
        if not command:
            return
        line = self.traps.get("EXIT line")
        if type(command) is Choice or not known(command):
            self.unfollow(line, "the command of trap ... EXIT, which the checker cannot tell")
            return
        self.change(self.traps, "EXIT", None)
        try:
            tree = ScriptParser(command).parse()
        except ShellSyntax:
            self.unfollow(line, "the command of trap ... EXIT")
            return
        self.subshells += 1  # bash keeps the status it exits with when the trap stops (set -u)
        try:
            self.run_list(tree)
        except (ScriptExit, FunctionReturn, LoopBreak, LoopContinue):
            pass
        finally:
            self.subshells -= 1

    def die(self, line, why):
        """The script stops here with a failure: recorded when the default
        invocation surely gets here (no undecided condition, no subshell)."""
        if self.condition is None and not self.subshells and self.death is None:
            self.death = (self.line or line, why)
        raise ScriptExit(False)

    def default_target(self):
        """N when the script takes its single target from `${2:-N}`."""
        values = {v for v in self.arg2_defaults if not any(m in v for m in MARKERS)}
        return values.pop() if len(values) == 1 else None

    def unfollow(self, line, what):
        self.unfollowed.append((self.line or line, what))
        self.wrote = True
        self.unsure = True  # what it does not follow may set any variable

    # -- state, for the branches of a condition the reader cannot decide
    def change(self, table, name, value):
        """Set (None: unset) a variable, array or function.  Every change
        goes through here and onto the trail, so that a branch is undone by
        what it changed, not by copying every variable (which made the time
        grow with variables times conditions)."""
        self.trail.append((table, name, table.get(name)))
        if value is None:
            table.pop(name, None)
        else:
            table[name] = value

    def mark(self):
        return len(self.trail), list(self.args), self.cwd

    def undo(self, mark):
        """Back to the state at `mark`; what was changed since, as it is now."""
        changed = {}
        while len(self.trail) > mark[0]:
            table, name, before = self.trail.pop()
            changed.setdefault((id(table), name), (table, name, table.get(name)))
            if before is None:
                table.pop(name, None)
            else:
                table[name] = before
        self.args, self.cwd = list(mark[1]), mark[2]
        return changed

    def subshell(self, run):
        """What a ( subshell ) or a pipeline's command sets stays inside;
        its status is that of its last command or its exit."""
        mark = self.mark()
        self.subshells += 1
        self.change(self.traps, "EXIT", None)  # a subshell does not inherit traps
        try:
            try:
                status = run()
            except ScriptExit as end:
                status = end.status
            self.run_exit_trap()
            return status
        finally:
            self.subshells -= 1
            self.undo(mark)

    def either(self, label, alternatives):
        """Run each alternative from the same state, then merge what they
        left: a variable they set differently is UNDECIDED, a function they
        define differently is each definition in turn.  Status None."""
        start = self.mark()
        ends = []
        outer = self.condition
        self.condition = outer or label
        try:
            for alternative in alternatives:
                try:
                    alternative()
                except ScriptExit:
                    self.undo(start)
                    continue
                except (FunctionReturn, LoopBreak, LoopContinue):
                    pass
                args, cwd = self.args, self.cwd  # undo() puts them back
                ends.append((self.undo(start), args, cwd))
        finally:
            self.condition = outer
        if not ends:
            raise ScriptExit()
        for key in {key for changed, _, _ in ends for key in changed}:
            table, name = next(c[key] for c, _, _ in ends if key in c)[:2]
            values = [c[key][2] if key in c else table.get(name) for c, _, _ in ends]
            if any(v != values[0] for v in values):
                values[0] = (undecided("$%s (%s)" % (name, label)) if table is self.vars else
                             [undecided("${%s[@]} (%s)" % (name, label))] if table is self.arrays
                             else Choice(label, list(values)))
            self.change(table, name, values[0])
        self.args, self.cwd = ends[0][1], ends[0][2]
        if any(args != self.args for _, args, _ in ends):  # shift or set -- on a branch
            self.args = [undecided("$%d (%s)" % (number, label))
                         for number in range(1, max(len(args) for _, args, _ in ends) + 1)]
            self.origin = None
        if any(cwd != self.cwd for _, _, cwd in ends):
            self.cwd = undecided("the directory (%s)" % label)
        return None

    # -- commands; each returns its status: True, False or None (cannot tell)
    def run_list(self, body):
        status = True
        for node in body:
            status = self.run(node)
            if status is False and type(node) is not AndOr and not getattr(node, "negated", False):
                self.errexit(node)
        return status

    def errexit(self, node):
        """set -e: a command that surely fails stops the script, outside a
        condition and the left of && and ||."""
        if self.options.get("errexit") is True and not self.quiet:
            self.die(node.line, "set -e stops the script where %s fails" % describe_node(node))

    def quietly(self, run):
        """Run where a failure does not stop the script (set -e is not applied)."""
        self.quiet += 1
        try:
            return run()
        finally:
            self.quiet -= 1

    def run(self, node):
        kind, line = type(node), node.line
        self.at = line
        self.wrote = self.wrote or line in self.writes
        if kind is Simple:
            return self.run_simple(line, node.words)
        if kind is AndOr:
            return self.run_andor(node)
        if kind is Pipeline:
            return self.run_pipeline(node)
        if kind is If:
            return self.run_if(line, node.clauses, node.otherwise)
        if kind is Case:
            return self.run_case(line, node.word, node.items)
        if kind is Arithmetic:
            return self.arithmetic_status(line, [node.expression])
        if kind is For:
            return self.run_for(line, node.name, node.words, node.body)
        if kind is While:
            return self.run_while(line, node.until, node.condition, node.body)
        if kind is ArithmeticFor:  # how often it runs is not told: its names are unknown
            self.arithmetic_status(line, node.expression.split(";"))
            return self.either("the for loop at line %d" % line, [lambda: self.run_list(node.body),
                                                                   lambda: None])
        if kind is Function:
            self.change(self.functions, node.name, node.body)
            self.defined_in[node.name] = self.sourced[-1] if self.sourced else None
            return True
        if node.subshell:
            return self.subshell(lambda: self.run_list(node.body))
        return self.run_list(node.body)

    def run_pipeline(self, node):
        """Each command of a | pipeline in a subshell, the last one in the
        shell itself under `shopt -s lastpipe`; `!` is a condition."""
        lastpipe = self.options.get("lastpipe")
        if len(node.commands) > 1 and lastpipe not in (None, True):
            self.unfollow(node.line, "a pipeline after shopt -s lastpipe on some branches only")
        status = True
        for at, command in enumerate(node.commands):
            def run(command=command):
                return self.quietly(lambda: self.run(command)) if node.negated else self.run(command)
            last = at == len(node.commands) - 1
            status = run() if len(node.commands) == 1 or (last and lastpipe is True) else self.subshell(run)
        return (None if status is None else not status) if node.negated else status

    def run_andor(self, node):
        """a && b || c: each pipeline by the status before it; set -e
        applies only to the last one."""
        status = self.quietly(lambda: self.run(node.first))
        for at, (op, pipeline) in enumerate(node.rest):
            runs = status if op == "&&" else (None if status is None else not status)

            def run(pipeline=pipeline, last=at == len(node.rest) - 1):
                result = self.run(pipeline) if last else self.quietly(lambda: self.run(pipeline))
                if result is False and last:
                    self.errexit(pipeline)
                return result
            if runs:
                status = run()
            elif runs is None:
                status = self.either("%s at line %d" % (describe_node(node.first), node.line),
                                     [run, lambda: None])
        return status

    def run_if(self, line, clauses, otherwise):
        if not clauses:
            return self.run_list(otherwise) if otherwise is not None else True
        condition, body = clauses[0]
        status = self.quietly(lambda: self.run_list(condition))
        if status:
            return self.run_list(body)
        if status is False:
            return self.run_if(line, clauses[1:], otherwise)
        label = "if %s at line %d" % (describe_node(condition[-1] if condition else None), line)
        return self.either(label, [lambda: self.run_list(body),
                                   lambda: self.run_if(line, clauses[1:], otherwise)])

    def run_case(self, line, word, items):
        value = self.expand_one(word).replace(NOT_REACHED, "")
        paths = self.case_paths(value, items, 0, {})
        if paths is None:
            self.unfollow(line, "a case with more than %d ways to run" % SH_MAX_LOOPS)
            raise ScriptExit()
        if len(paths) == 1:
            for body in paths[0]:
                self.run_list(body)
            return True
        label = "case %s at line %d" % (word, line)
        return self.either(label, [lambda p=p: [self.run_list(b) for b in p] for p in paths])

    def case_paths(self, value, items, start, known_paths):
        """The bodies each possible run of a case runs, testing from item
        `start`: ;& runs the next body untested, ;;& goes on testing.  None
        for more than SH_MAX_LOOPS runs (each ;;& an undecided test doubles
        them); `known_paths` keeps the answer for each start."""
        if start not in known_paths:
            paths = self.case_paths_from(value, items, start, known_paths)
            known_paths[start] = paths if paths is None or len(paths) <= SH_MAX_LOOPS else None
        return known_paths[start]

    def case_paths_from(self, value, items, start, known_paths):
        for at in range(start, len(items)):
            pieces = [self.expand_one(p) for p in items[at][0]]
            results = [self.matches(value, p) for p in pieces]
            matched = True in results
            decided = None not in results and known(value) and all(known(p) for p in pieces)
            if not matched and decided:
                continue
            end = at
            while items[end][2] == ";&" and end + 1 < len(items):
                end += 1
            rest = self.case_paths(value, items, end + 1, known_paths) if items[end][2] == ";;&" else [[]]
            if rest is None:
                return None
            paths = [[body for _, body, _ in items[at:end + 1]] + path for path in rest]
            if matched and decided:
                return paths
            others = self.case_paths(value, items, at + 1, known_paths)
            return None if others is None else paths + others
        return [[]]

    def run_for(self, line, name, words, body):
        values = list(self.args) if words is None else self.expand_words(words)
        if all(known(v) for v in values):
            for value in values:
                self.assign(name, value, line)
                try:
                    self.run_list(body)
                except LoopBreak:
                    break
                except LoopContinue:
                    continue
            return True
        label = "the for loop at line %d over %s" % (line, " ".join(map(show_word, values))[:80])

        def once():
            self.assign(name, undecided("$%s (%s)" % (name, label)), line)
            self.run_list(body)
        return self.either(label, [once, lambda: None])

    def run_while(self, line, until, condition, body):
        for _ in range(SH_MAX_LOOPS):
            status = self.quietly(lambda: self.run_list(condition))
            if status is not None and until:
                status = not status
            if status is False:
                return True
            if status is None:
                label = "%s loop at line %d" % ("until" if until else "while", line)
                return self.either(label, [lambda: self.run_list(body), lambda: None])
            try:
                self.run_list(body)
            except LoopBreak:
                return True
            except LoopContinue:
                pass
        self.unfollow(line, "a while loop that runs more than %d times" % SH_MAX_LOOPS)
        raise ScriptExit()

    def run_simple(self, line, words):
        self.steps += 1
        if self.steps > SH_MAX_STEPS:
            self.unfollow(line, "more than %d commands to follow" % SH_MAX_STEPS)
            raise ScriptExit()
        index = 0
        while index < len(words) and SH_ASSIGNMENT_RE.match(words[index]):
            index += 1
        if index == len(words):
            for word in words:
                self.assign_word(word, line)
            return True
        alias = self.aliases.get(words[index]) if self.options.get("expand_aliases") is True else None
        if alias is not None:
            if type(alias) is Choice or not known(alias) or self.depth or any(
                    kind == "op" for kind, _, _ in tokenize(alias)):
                self.unfollow(line, "the alias %s" % words[index])
                return None
            words = words[:index] + array_words(alias) + words[index + 1:]
            if index == len(words):
                return True
        if words[index] in SH_DECLARE_WORDS:
            for word in words[index + 1:]:
                if word.startswith("-"):
                    self.unsure = self.unsure or "n" in word  # a name reference
                    continue
                if SH_SPECIAL_RE.search(word.partition("=")[0]):
                    self.unsure = True  # declare "$name=value": a name it cannot tell
                    continue
                assignment = SH_ASSIGNMENT_RE.match(word)
                name = assignment.group(1) if assignment else word
                if words[index] == "local" and self.frames:
                    self.frames[-1].setdefault(name, (self.vars.get(name), self.arrays.get(name)))
                    if not assignment:
                        self.change(self.vars, name, None)
                        self.change(self.arrays, name, None)
                if assignment:
                    self.assign_word(word, line)
            return True
        if words[index] == "[[" and words[-1] == "]]":
            return self.double_bracket(words[index + 1:-1])
        # A compiler reads the variables given to it alone (NVCC_APPEND_FLAGS=... nvcc).
        environment = {}
        for word in words[:index]:
            match = SH_ASSIGNMENT_RE.match(word)
            environment[match.group(1)] = self.expand_one(word[match.end():])
        argv = self.expand_words(words[index:])
        return self.run_argv(line, argv, environment)

    def double_bracket(self, words):
        """[[ ... ]]: no word splitting, and the right of == or != is a glob
        pattern, taken literally where quoted."""
        args = [self.expand_one(w).replace(NOT_REACHED, "") for w in words]
        if not any(c in a for a in args for c in "*?[") and "nocasematch" not in self.options:
            return test_expression(args)
        if len(args) != 3 or args[1] not in ("=", "==", "!=") or SH_SPECIAL_RE.search(
                words[2]) or not known(args[0]) or OUT_DIR in args[0]:
            return None
        matched = self.matches(args[0], args[2])
        return None if matched is None else matched == (args[1] != "!=")

    def matches(self, value, pattern):
        """A case or [[ == ]] pattern match; shopt -s nocasematch ignores case."""
        nocase = self.options.get("nocasematch")
        if nocase not in (None, True):
            return None
        if nocase:
            value, pattern = value.lower(), pattern.lower()
        return fnmatch.fnmatchcase(value, pattern)

    def run_argv(self, line, argv, environment=None):
        bypass = None  # command and builtin run no function of that name
        while argv and argv[0] in SH_PREFIX_COMMANDS and not (
                argv[0] == "command" and argv[1:2] in (["-v"], ["-V"])):
            if argv[0] in ("command", "builtin"):
                bypass = argv[0]
            argv = self.after_prefix(line, argv)
        if not argv:
            return True if argv is not None else None
        command = argv[0]
        makes = command not in SH_MAKES_NO_DIRECTORY and not is_compiler_name(command)
        if makes and any(OUT_DIR in a or not known(a) for a in argv):
            self.change(self.options, "<output-dir> made", True)  # mkdir -p "$1", or may be
        if command in self.functions and bypass is None:
            return self.call_function(line, command, argv[1:])
        if command == "mkdir" and any(a[:1] != "-" and OUT_DIR not in a for a in argv[1:]):
            self.made_directory = True  # mkdir -p build: a cd there, a ../k.cu from there, may work
        if makes and command != "mkdir":
            self.wrote = True  # cp a.cu b.cu, python3 gen.py: it may make what a compiler reads
        builtin = SH_BUILTINS.get(command)
        if builtin is not None:
            return builtin(self, line, argv)
        if bypass == "builtin":
            return False if known(command) else None  # bash: not a shell builtin
        # The script's variables, exported or not, stand for the compiler's environment.
        call = compiler_call(argv, self.line or line, self.cwd, dict(self.vars, **(environment or {})))
        if call is not None:
            call.condition = self.condition
            writes = [o for o in call.outputs if o.startswith(OUT_DIR + "/")]
            call.after_write, self.wrote = self.wrote, self.wrote or len(writes) < len(call.outputs)
            self.calls.append(call)
            if writes and "<output-dir> made" not in self.options and not self.unsure and (
                    self.condition is None and not self.subshells):
                self.failures.append((self.line or line, (
                    "%s cannot write %s: nothing before it creates <output-dir>, and the build tier "
                    "and CI pass one that does not exist yet; add mkdir -p \"$1\""
                    % (call.compiler, show_word(writes[0])))))
            self.placements.extend(("add", posixpath.normpath(o[len(OUT_DIR) + 1:]), call.line, None)
                                   for o in writes)
            return True
        if command in SH_BUILD_TOOLS:
            self.unfollow(line, "%s, whose build rules it does not read" % command)
            self.programs.add(self.line or line)
            return None
        name = command.rsplit("/", 1)[-1]
        # A program it does not read, or one it does not know running a compiler (sudo nvcc ...).
        if SH_PROGRAM_RE.match(name) or ("/" in command and not command.startswith(("/bin/", "/usr/bin/"))) or (
                command != "echo" and any(is_compiler_name(word) for word in argv[1:])):
            self.unfollow(line, "%s, a program whose commands it does not read"
                          % show_word(" ".join(argv[:2]))[:80])
            self.programs.add(self.line or line)
            return None
        sources = [a for a in argv[1:] if a.endswith(COMPILED_SUFFIXES)]
        if sources and command not in SH_FILE_TOOLS:  # mpicxx, bisheng: it may compile them
            self.unfollow(line, "%s, a program it does not know, given %s" % (
                show_word(command) or '""', show_word(sources[0])))
            self.programs.add(self.line or line)
            return None
        return None if command in SH_QUERY_COMMANDS or not known(command) else True

    def after_prefix(self, line, argv):
        """The command a prefix command (nice -n 19, timeout 600, env A=1)
        runs; None after an option the reader does not follow."""
        valued, operands = SH_PREFIX_COMMANDS[argv[0]]
        words = argv[1:]
        while words and (words[0].startswith("-") or (argv[0] == "env" and "=" in words[0])):
            word = words.pop(0)
            if word == "--":
                break
            if word.split("=")[0] in SH_PREFIX_UNFOLLOWED and argv[0] == "env":
                self.unfollow(line, "env %s" % word)
                return None
            if word in valued:
                words = words[1:]
        return words[operands:]

    def call_function(self, line, name, args):
        if self.depth >= SH_MAX_DEPTH:
            self.unfollow(line, "functions nested deeper than %d calls" % SH_MAX_DEPTH)
            return None
        saved, origin = self.args, self.origin
        self.args, self.origin = list(args), None
        self.frames.append({})
        self.depth += 1
        self.sourced.append(self.defined_in.get(name))  # its ${BASH_SOURCE[0]}
        try:
            return self.run_function(self.functions[name])
        except FunctionReturn as end:
            return end.status
        finally:
            self.sourced.pop()
            self.depth -= 1
            for local, (value, array) in self.frames.pop().items():
                self.change(self.vars, local, value)
                self.change(self.arrays, local, array)
            self.args, self.origin = saved, origin

    def run_function(self, body):
        """A function's body; one defined differently on the branches of a
        condition the reader cannot decide is run as each of them."""
        if body is None:
            return None
        if type(body) is not Choice:
            return self.run(body)
        return self.either(body.label, [lambda b=b: self.run_function(b) for b in body.bodies])

    # -- builtins
    def builtin_true(self, line, argv):
        return argv[0] != "false"

    def builtin_test(self, line, argv):
        args = argv[1:]
        if argv[0] in ("[", "[["):
            if not args or args[-1] != ("]" if argv[0] == "[" else "]]"):
                return None
            args = args[:-1]
        return test_expression([a.replace(NOT_REACHED, "") for a in args])

    def builtin_lookup(self, line, argv):
        names = [a for a in argv[1:] if not a.startswith("-")]
        return True if names and all(is_compiler_name(n) for n in names) else None

    def builtin_shift(self, line, argv):
        count = argv[1] if len(argv) > 1 else "1"
        if not count.isdigit():
            self.args, self.origin = [undecided("the arguments after shift %s" % show_word(count))], None
            return None
        count = int(count)
        self.args = self.args[count:]
        if self.origin is not None:
            self.origin += count
        return True

    def builtin_set(self, line, argv):
        """set -eu, set -o errexit, set +e, set -- args."""
        words = iter(argv[1:])
        for word in words:
            if word == "--":
                self.args, self.origin = list(words), None
                break
            if word[:1] in "-+" and word[1:].isalpha():  # -eu, +e, -o errexit
                for letter in word[1:]:
                    option = next(words, "") if letter == "o" else OPTION_LETTERS.get(letter)
                    if option in OPTION_LETTERS.values():
                        self.change(self.options, option, True if word[0] == "-" else None)
            elif word in ("-", "+"):
                continue
            else:
                self.args, self.origin = [word] + list(words), None
                break
        return True

    def builtin_shopt(self, line, argv):
        flag = argv[1] if len(argv) > 1 else ""
        if flag in ("-s", "-u"):
            for name in argv[2:]:
                if name in ("lastpipe", "expand_aliases", "nocasematch"):
                    self.change(self.options, name, True if flag == "-s" else None)
        return True

    def builtin_alias(self, line, argv):
        """alias name=value; unalias name (unalias -a: all)."""
        for word in argv[1:]:
            name, equals, value = word.partition("=")
            if argv[0] == "unalias":
                for name in (list(self.aliases) if word == "-a" else [word]):
                    self.change(self.aliases, name, None)
            elif equals:
                self.change(self.aliases, name, value)
        return True

    def builtin_trap(self, line, argv):
        """trap CMD SIGNAL...: the EXIT trap runs when the script ends; one
        on ERR, DEBUG or RETURN runs at times the reader does not follow."""
        args = argv[1:]
        if args[:1] == ["--"]:
            args = args[1:]
        if len(args) < 2 or args[0].startswith("-") and args[0] != "-":
            return True  # trap -p, trap -l, trap SIGNAL
        command = None if args[0] == "-" else args[0]
        for signal in args[1:]:
            signal = signal.upper()
            if signal in ("EXIT", "0", "SIGEXIT"):
                self.change(self.traps, "EXIT", command)
                self.change(self.traps, "EXIT line", self.line or line)
            elif signal in ("ERR", "DEBUG", "RETURN", "SIGERR") and command:
                self.unfollow(line, "the command of trap ... %s" % signal)
        return True

    def builtin_unset(self, line, argv):
        for name in argv[1:]:
            if "[" in name:  # one element: the others keep their indices, which are not modelled
                array = name.split("[")[0]
                self.change(self.arrays, array, [undecided("${%s[@]} (after unset %s)" % (array, name))])
                continue
            # $PWD and the like: the reader's own value would outlive it (cd sets PWD again).
            self.change(self.vars, name, undecided("$%s (after unset)" % name)
                        if name in SH_RUNTIME_VARIABLES else None)
            self.change(self.arrays, name, None)
        return True

    def builtin_cd(self, line, argv):
        target = [a for a in argv[1:] if a not in ("-P", "-L", "--")]
        if argv[0] == "popd":
            self.cwd = self.dirs.pop() if self.dirs else undecided("the directory popd returns to")
            return True
        if argv[0] == "pushd":
            self.dirs.append(self.cwd)
        if not target or target[0] == "-":
            self.cwd = undecided("the directory of cd %s" % " ".join(target))
        elif target[0].startswith(("/",) + MARKERS) or self.cwd is None:
            self.cwd = target[0]
        else:
            self.cwd = self.cwd + "/" + target[0]
        place = script_place(self.script_dirs, self.cwd)
        if place is not None and self.directory is not None and self.script_dir is not None and not (
                self.wrote or self.made_directory or os.path.isdir(os.path.join(
                    self.directory, self.script_dir, place))):
            self.cwd = undecided("the directory of cd %s, which is not there" % show_word(target[0]))
            return None  # bash stays where it was, or stops under set -e
        return True

    def builtin_exit(self, line, argv):
        code = argv[1] if len(argv) > 1 else None
        status = code == "0" or (None if code is None or not code.isdigit() else False)
        if argv[0] == "return" and self.frames:
            raise FunctionReturn(status)
        if status is False:
            self.die(line, "exit %s" % code)
        raise ScriptExit(status)

    def builtin_loop(self, line, argv):
        raise LoopBreak() if argv[0] == "break" else LoopContinue()

    def builtin_source(self, line, argv):
        if len(argv) < 2:
            return None
        path = argv[1]
        rel = self.sourced_file(path)
        text = None if rel is None else read_text(self.directory + "/" + rel, regular=True)[0]
        if text is None:
            self.unfollow(line, "%s %s, which is no file in the backend directory"
                          % (argv[0], show_word(path)))
            return None
        if self.depth >= SH_MAX_DEPTH:
            self.unfollow(line, "files sourced deeper than %d" % SH_MAX_DEPTH)
            return None
        try:
            tree = ScriptParser(text).parse()
        except ShellSyntax as problem:
            self.unfollow(line, "%s (line %d of %s)" % (problem.args[1], problem.args[0], rel))
            return None
        except RecursionError:
            self.unfollow(line, "%s, nested deeper than it reads" % rel)
            return None
        outer = self.line
        self.line = self.line or line
        self.depth += 1
        self.sourced.append(rel)
        try:
            return self.run_list(tree)
        finally:
            self.sourced.pop()
            self.depth -= 1
            self.line = outer

    def cwd_placed(self):
        """Whether the current directory is one the reader places from the script's."""
        return self.cwd is not None and script_place(self.script_dirs, self.cwd) is not None

    def sourced_file(self, path):
        """The file `source path` reads, relative to the backend directory,
        when the path starts at the script's directory (given so, or relative
        to a directory cd made one) and stays inside the backend directory,
        links resolved; None where it cannot be told."""
        if not path.startswith(("/",) + MARKERS):
            if self.cwd is None or "/" not in path:
                return None  # from where the script is run; a bare name bash looks up in PATH first
            path = self.cwd + "/" + path
        place = script_place(self.script_dirs, path)
        if place is None or self.directory is None or self.script_dir is None:
            return None
        full = os.path.join(self.directory, self.script_dir, place)
        if not os.path.isfile(full):  # as the kernel resolves it: nosuch/../env.sh is no file
            return None
        real, top = os.path.realpath(full), os.path.realpath(self.directory)
        return os.path.relpath(real, top) if real.startswith(top.rstrip("/") + "/") else None

    def builtin_read(self, line, argv):
        """read, getopts, mapfile: what they set comes from outside the script."""
        command = argv[0]
        takes_value = {"read": "dinNptu", "getopts": ""}.get(command, "dnOsuCc")
        names = []
        words = iter(argv[1:])
        for word in words:
            if word == "-a":
                names.append(next(words, ""))
            elif word.startswith("-") and word[1:] in tuple(takes_value):
                next(words, None)
            elif not word.startswith("-"):
                names.append(word)
        if command == "getopts":
            if len(argv) == 3 and self.vars.get("OPTIND", "1") == "1" and self.args[:1] in ([], [OUT_DIR]):
                return False  # the default invocation passes no option: <output-dir> ends them
            names = names[1:2]
        elif command in ("mapfile", "readarray"):
            names = names[-1:] or ["MAPFILE"]
        for name in names:
            if SH_NAME_RE.match(name):
                self.assign(name, runtime("$%s (%s at line %d)" % (name, command, line)))
        return None

    def builtin_place(self, line, argv):
        """cp, mv, ln, install and rm: what they put into <output-dir> or take out of it."""
        command, operands, directory, words = argv[0], [], None, iter(argv[1:])
        symbolic, targets = False, {}  # ln -s: the text of each link, as written
        for word in words:
            if word in ("-t", "--target-directory") or word.startswith("--target-directory="):
                directory = word.partition("=")[2] or next(words, "")
            elif word in ("-m", "-o", "-g", "--mode", "--owner", "--group") and command == "install":
                next(words, None)
            elif not word.startswith("-") or word == "-":
                operands.append(self.joined(word))
                targets[operands[-1]] = word
            else:
                symbolic = symbolic or word == "--symbolic" or (word[1:2] != "-" and "s" in word)
        symbolic = symbolic and command == "ln"
        sources = operands if directory is not None else operands[:-1]
        if command in ("cp", "mv", "install") and not all(map(self.may_exist, sources)):
            return False  # a file it surely did not put into <output-dir>: the command fails
        if command == "rm":
            for path in operands:
                self.place("remove", path, line)
            return True
        if directory is None and len(operands) < 2:
            return True
        if directory is None:
            destination, operands = operands[-1], operands[:-1]
            if len(operands) > 1 or destination.endswith("/") or destination == OUT_DIR:
                directory = destination
            else:  # cp a "$1/libx.so"; "$1/lib" may be the file or a directory it goes into
                self.place("add", destination, line, "." in destination.rsplit("/", 1)[-1],
                           targets[operands[0]] if symbolic and operands else None)
        for source in operands:
            name = source.rstrip("/").rsplit("/", 1)[-1]
            if directory is not None:  # cp build/* "$1/", cp -r build/. "$1/": names it cannot tell
                self.place("add", directory.rstrip("/") + "/" + name, line,
                           name not in ("", ".", "..") and not any(c in name for c in "*?["),
                           targets[source] if symbolic else None)
            if command == "mv":
                self.place("remove", source, line)
        return True

    def may_exist(self, path):
        """False for a file in <output-dir> that is surely not there now."""
        if not path.startswith(OUT_DIR + "/") or not known(path) or any(c in path for c in "*?["):
            return True
        landed, maybe = ScriptFacts(self.calls, placements=self.placements).landing()
        return bool(maybe) or any(c for _, _, _, c in self.placements) or (
            posixpath.normpath(path[len(OUT_DIR) + 1:]) in landed)

    def joined(self, path):
        """A path as the compiler outputs are spelt: relative ones joined to the directory."""
        if self.cwd is not None and not path.startswith(("/",) + MARKERS):
            return self.cwd + "/" + path
        return path

    def place(self, op, path, line, named=True, link=None):
        """Record what a command puts into <output-dir> or takes out of it
        (`named`: whether `path` surely names the file, not a directory;
        `link`: the text of a symbolic link made there), and what it
        removes elsewhere, where a link may point."""
        inside = path == OUT_DIR or path.startswith(OUT_DIR + "/")
        if op == "remove" and not inside:
            self.change(self.removed, path, line if self.condition is None else None)
        if not inside and known(path):
            return  # elsewhere
        if inside and known(path) and named:
            path = posixpath.normpath(path[len(OUT_DIR):].lstrip("/")) if path != OUT_DIR else ""
            self.placements.append((op, "" if path == "." else path, line, self.condition))
            if op == "add":
                self.change(self.links, path, (link, line) if link and self.condition is None else None)
        elif op == "add":
            self.placements.append((op, None, line, self.condition))

    def dangling(self, landed):
        """{file in <output-dir>: the text of the link it is}, for each link
        surely left there whose target is surely not there when the script
        ends: relative to <output-dir> and not in it, or removed after."""
        found = {}
        for path, entry in self.links.items():
            if type(entry) is not tuple or path not in landed:
                continue
            text = entry[0]
            if not text.startswith(("/",) + MARKERS):
                target = posixpath.normpath(posixpath.join(posixpath.dirname(path), text))
                if not target.startswith("../") and target != ".." and target not in landed:
                    found[path] = text
            elif any(line is not None and (text == gone or text.startswith(gone.rstrip("/") + "/"))
                     for gone, line in self.removed.items()):
                found[path] = text
        return found

    def builtin_printf(self, line, argv):
        if argv[1:2] == ["-v"] and len(argv) > 3 and SH_NAME_RE.match(argv[2]):
            value = printf_value(argv[3], argv[4:])
            self.assign(argv[2], value if value is not None else runtime(
                "$%s (printf -v at line %d)" % (argv[2], line)))
        return True

    def builtin_let(self, line, argv):
        return self.arithmetic_status(line, argv[1:])

    def arithmetic_status(self, line, expressions):
        """(( ... )) and let: true when the last expression is not 0; a name
        they assign to is what the reader cannot tell afterwards."""
        status = None
        for expression in expressions:
            assigned = [a or b for a, b in SH_ARITH_ASSIGNMENT_RE.findall(expression)]
            for name in assigned:
                self.assign(name, undecided("$%s (assigned in arithmetic at line %d)" % (name, line)))
            value = None if assigned else self.arithmetic(expression)
            status = None if value is None else value != 0
        return status

    def builtin_eval(self, line, argv):
        """eval: shell text the reader does not read."""
        self.unfollow(line, "eval")
        return None

    # -- variables
    def assign_word(self, word, line):
        """Perform `name=value`, `name+=value`, `name=(...)` or `name[i]=value`."""
        match = SH_ASSIGNMENT_RE.match(word)
        name, index, append = match.group(1), match.group(2), match.group(3)
        value = word[match.end():]
        if value.startswith("(") and value.endswith(")") and index is None:
            items = self.expand_words(array_words(value[1:-1]))
            if append:
                items = self.arrays.get(name, [self.vars[name]] if name in self.vars else []) + items
            self.change(self.vars, name, None)
            self.change(self.arrays, name, items if sum(map(len, items)) <= SH_MAX_CHARS else [
                undecided("${%s[@]} (longer than %d characters)" % (name, SH_MAX_CHARS))])
            return
        text = self.expand_one(value)
        if index is not None:
            position = self.expand_one(index[1:-1])
            items = list(self.arrays.get(name, []))
            if position.isdigit() and int(position) <= len(items):
                items[int(position):int(position) + 1] = [text]
            else:
                items.append(undecided("${%s[%s]}" % (name, position)))
            self.change(self.arrays, name, items)
            return
        if append:
            text = self.vars.get(name, "") + text
        self.assign(name, text, line)

    def assign(self, name, value, line=None):
        if len(value) > SH_MAX_CHARS:
            value = undecided("$%s (longer than %d characters)" % (name, SH_MAX_CHARS))
        self.change(self.arrays, name, None)
        self.change(self.vars, name, value)

    def lookup(self, name):
        """The value of a name, or None when the default invocation leaves it unset."""
        if name in self.arrays:
            items = self.arrays[name]
            return items[0] if items else ""
        if name in self.vars:
            return self.vars[name]
        if name.isdigit():
            number = int(name)
            if number == 0:
                return runtime("$0")
            return self.args[number - 1] if number <= len(self.args) else None
        if name == "#":
            return str(len(self.args))
        if name in ("@", "*"):
            return " ".join(self.args)
        if name in SH_RUNTIME_VARIABLES or name in ("$", "!", "?", "-"):
            return runtime("$" + name)
        return None

    # -- expansion
    def expand_one(self, word):
        """A word expanded to one string (an assignment's value, a case word)."""
        return "".join(self.expand(word, split=False))

    def expand_words(self, words):
        fields = []
        for word in words:
            fields.extend(self.expand(word, split=True))
        return fields

    def expand(self, word, split):
        """The fields a word expands to: variables, command substitutions and
        quotes done; with `split`, unquoted expansions split at blanks."""
        if word.startswith(("<(", ">(")):
            if runs_compiler(word[2:-1]):
                self.unfollow(self.at, "a compiler run inside %s" % word[:60])
            return [runtime(word)]
        if split and "{" in word:
            words = brace_expansion(word)
            if words != [word]:
                return [field for each in words for field in self.expand(each, split)]
        if SH_SPECIAL_RE.search(word) is None:
            return [word]
        if split and (word == '"$@"' or (word.startswith('"${') and word.endswith('[@]}"'))):
            value = self.parameter(word[3:-2], word, True) if word != '"$@"' else list(self.args)
            if isinstance(value, list):
                return value
        fields = [""]
        quoted = False  # whether the last field holds quoted text
        pos, length = 0, len(word)
        in_double = False
        while pos < length:
            char = word[pos]
            if char == '"':
                in_double = not in_double
                quoted = True
                pos += 1
                continue
            if char == "'" and not in_double:
                end = word.find("'", pos + 1)
                end = length if end < 0 else end
                fields[-1] += word[pos + 1:end]
                quoted = True
                pos = end + 1
                continue
            if char == "\\":
                following = word[pos + 1:pos + 2]
                if following != "\n":
                    if in_double and following not in '$`"\\':
                        fields[-1] += "\\"
                    fields[-1] += following
                pos += 2
                continue
            if char == "`" or (char == "$" and word.startswith("$(", pos)):
                start = pos + (1 if char == "`" else 2)
                end = scan_balanced(word, start, "`" if char == "`" else ")")
                value = self.substitute(word[pos:end], word[start:end - 1])
                pos = end
            elif char == "$" and word.startswith("${", pos):
                end = scan_balanced(word, pos + 2, "}")
                value = self.parameter(word[pos + 2:end - 1], word[pos:end], in_double)
                pos = end
            elif char == "$" and word.startswith("$'", pos) and not in_double:
                end = pos + 2
                while end < length and word[end] != "'":
                    end += 2 if word[end] == "\\" else 1
                fields[-1] += ansi_c(word[pos + 2:end])
                quoted = True
                pos = end + 1
                continue
            elif char == "$":
                name = re.match(r"[A-Za-z_][A-Za-z0-9_]*|[0-9#@*?$!-]", word[pos + 1:])
                if name is None:
                    fields[-1] += "$"
                    pos += 1
                    continue
                name = name.group()
                pos += 1 + len(name)
                value = self.parameter(name, "$" + name, in_double)
            else:
                special = SH_SPECIAL_RE.search(word, pos + 1)
                end = special.start() if special else length
                fields[-1] += word[pos:end]
                pos = end
                continue
            if isinstance(value, list) and not split:
                value = " ".join(value)
            if isinstance(value, list):  # "$@", "${a[@]}": one field each
                if value:
                    fields[-1] += value[0]
                    fields.extend(value[1:])
                quoted = quoted or bool(value)
            elif split and not in_double and self.vars.get("IFS", " \t\n") not in (" \t\n", " "):
                fields[-1] += undecided("%s (split at IFS=%r)" % (value, self.vars.get("IFS")))
            elif split and not in_double:
                pieces = SH_FIELD_RE.findall(value)
                if pieces:
                    if value[:1].isspace() and (fields[-1] or quoted):
                        fields.append("")
                    fields[-1] += pieces[0]
                    fields.extend(pieces[1:])
                    if value[-1:].isspace():
                        fields.append("")
                        quoted = False
            else:
                fields[-1] += value
                quoted = True if in_double else quoted
        if split and fields[-1] == "" and not quoted:
            fields.pop()
        return fields

    def substitute(self, source, command):
        """$(...) or `...`: the value is the command's output, unknown here,
        unless it names the <output-dir> argument (cd "$1" && pwd); and
        $((...)), arithmetic, when every name in it is known."""
        if source.startswith("$((") and source.endswith("))"):
            value = self.arithmetic(source[3:-2], expansion=True)
            return undecided(source) if value is None else str(value)
        if ">" in SH_NO_FILE_REDIRECT_RE.sub("", command) or not all(
                part.split()[0].strip("\"'") in SH_MAKES_NO_DIRECTORY
                for part in re.split(r"&&|\|\||[;|(`]", command) if part.split()):
            self.wrote = True  # $(python3 gen.py) may make what a compiler reads
        if command.strip() in ("pwd", "pwd -L") and self.cwd_placed():
            return self.cwd
        if self.sourced and self.sourced[-1] is not None and "BASH_SOURCE" in command:  # that file
            return runtime(re.sub(r"\$\{BASH_SOURCE(?:\[0\])?\}|\$BASH_SOURCE\b", lambda _: self.sourced[-1],
                                  source))  # shown as $(dirname "sub/env.sh")
        same = SH_SAME_DIR_RE.match(command)
        if same:
            target = self.expand_one(same.group(1) or same.group(2) or same.group(3))
            if target == OUT_DIR:
                return OUT_DIR
        dirname = SH_DIRNAME_RE.match(command)
        if (same or dirname) and not SH_ONLY_SCRIPT_RE.search(command) and len(source) < 100:
            target = target if same else self.expand_one(dirname.group(1))
            place = script_place(self.script_dirs, target)
            if target in self.script_paths and same:
                self.script_paths.add(runtime(source))
            elif target in self.script_paths or (same and place is not None and set(
                    place.split("/")) <= {"", ".", ".."}):  # no name that may be a link realpath resolves
                self.script_dirs[runtime(source)] = (place or ".")[1:]
        if runs_compiler(command):
            self.unfollow(self.at, "a compiler run inside %s" % source[:60])
        return runtime(source)

    def arithmetic(self, expression, expansion=False):
        """The value of a shell arithmetic expression (an unset name is 0),
        or None when a name in it holds no number the reader knows.  In an
        expansion ($((...))), a number bash refuses (08) stops the script."""
        def value(match):
            found = self.lookup(match.group(1) or match.group(2))
            found = "1" if found is None and match.group() == "OPTIND" else found or "0"
            if not re.match(r"-?[0-9]+\Z", found):
                raise Unevaluable()
            return "(%s)" % found
        expression = self.expand_one(expression)
        if not known(expression):
            return None
        try:
            text = re.sub(r"\$\{?([A-Za-z_][A-Za-z0-9_]*|[0-9#])\}?|([A-Za-z_][A-Za-z0-9_]*)",
                          value, expression)
        except Unevaluable:
            return None
        bad = re.search(r"(?<![0-9A-Za-z_.])0[0-7]*[89][0-9]*", text)
        if bad and expansion:  # bash drops the rest of the line
            self.unfollow(self.at, "$((%s)), where %s is no number bash takes (a leading 0 "
                          "makes it octal)" % (show_word(expression), bad.group()))
        return if_value(text)

    def nounset(self, name, index):
        """set -u: expanding an unset name stops the script."""
        if index is not None or self.options.get("nounset") is not True or SH_SHELL_VARIABLES_RE.match(name):
            return
        if self.unsure:  # set where the reader does not see, or not
            self.unfollow(self.at, "$%s under set -u, which stops the script if it is unset" % name)
        else:
            self.die(self.at, "set -u stops the script at $%s, which %s" % (name, (
                "the default invocation does not pass" if name.isdigit() else
                "is unset (the default invocation sets no optional variable)")))

    def parameter(self, body, source, in_double):
        """The value of ${body}; a list for ${a[@]} in double quotes."""
        if body.startswith("#") and len(body) > 1:
            if body.endswith(("[@]", "[*]")):
                return str(len(self.arrays.get(body[1:-3], ())))
            value = self.parameter(body[1:], source, False)
            return str(len(value)) if known(value) else runtime(source)
        if body.startswith("!"):
            return undecided(source)
        match = SH_PARAM_RE.match(body)
        if match is None:
            return undecided(source)
        name, index, op, rest = match.groups()
        if name in SH_RUNTIME_VARIABLES and name not in self.vars and name not in self.arrays:
            if name == "PWD" and index is None and op is None and self.cwd_placed():
                return self.cwd  # after cd "$(dirname "$0")": a directory the reader places
            return runtime(source)  # ${BASH_SOURCE[0]}: the machine's value, not an unset one
        if index is not None:
            items = self.arrays.get(name)
            if items is None:
                items = [self.vars[name]] if name in self.vars else []
            if index in ("[@]", "[*]"):
                if op in SH_ELEMENT_OPS:  # "${a[@]/#/$here/}": each element, as bash does
                    items = [self.transform(item, op, rest, source) for item in items]
                    op, rest = None, ""
                elif op == ":":  # ${a[@]:N:L}: elements, not characters
                    numbers = rest.split(":")
                    if not all(n.strip().isdigit() for n in numbers):
                        return undecided(source)
                    start = int(numbers[0])
                    items = items[start:start + int(numbers[1])] if len(numbers) > 1 else items[start:]
                    op, rest = None, ""
                elif op in (":-", "-") and items:  # set: the elements themselves
                    op, rest = None, ""
                if in_double and index == "[@]" and op is None:
                    return list(items)
                ifs = self.vars.get("IFS", " ")
                if index == "[*]" and in_double and not known(ifs):
                    return undecided(source)
                value = (ifs[:1] if index == "[*]" and in_double else " ").join(items) \
                    if items or name in self.arrays else None
            else:
                position = self.expand_one(index[1:-1])
                value = items[int(position)] if position.isdigit() and int(position) < len(items) else None
        elif name == "@" and in_double and op is None:
            return list(self.args)
        elif name in ("@", "*") and op == ":":  # ${@:N:L}: arguments, not characters
            numbers = rest.split(":")
            if not all(n.strip().isdigit() for n in numbers):
                return undecided(source)
            start = int(numbers[0])
            items = ([runtime("$0")] + self.args)[start:start + int(numbers[1]) if len(numbers) > 1 else None]
            return list(items) if in_double and name == "@" else " ".join(items)
        else:
            value = self.lookup(name)
        if op is None:
            if rest:
                return undecided(source)
            if value is None:
                self.nounset(name, index)
                return NOT_REACHED if name.isdigit() else ""
            return value
        if op in (":-", "-", ":=", "="):
            unset = value is None or (op[0] == ":" and value in ("", NOT_REACHED))
            if not unset:
                return value
            default = self.expand_one(rest)
            if default and name.isdigit() and self.origin is not None and int(name) + self.origin == 2:
                self.arg2_defaults.append(default)
            if op.endswith("=") and SH_NAME_RE.match(name):
                self.assign(name, default)
            return default
        if op in (":?", "?"):
            if value is None or (op == ":?" and value == ""):
                return undecided("%s (the script stops unless it is set)" % source)
            return value
        if op in (":+", "+"):
            set_ = value is not None and (op == "+" or value != "")
            return self.expand_one(rest) if set_ else ""
        return self.transform(value, op, rest, source)

    def transform(self, value, op, rest, source):
        """${v:o:l}, ${v%p}, ${v/a/b}, ${v^^} and the like of a value (None: unset)."""
        value = "" if value is None else value
        if not known(value):
            return runtime(source) if RUNTIME in value else undecided(source)
        if op == ":":  # ${v:offset} or ${v:offset:length}
            numbers = rest.split(":")
            if not all(n.strip().isdigit() for n in numbers):
                return undecided(source)
            start = int(numbers[0])
            return value[start:start + int(numbers[1])] if len(numbers) > 1 else value[start:]
        pattern = self.expand_one(rest) if op not in ("//", "/") else rest
        if op in ("%", "%%", "#", "##"):
            return remove_pattern(value, pattern, op)
        if op in ("/", "//"):
            old, _, new = rest.partition("/")
            anchor = old[:1] if old[:1] in ("#", "%") and op == "/" else ""  # ${v/#a/b}, ${v/%a/b}
            return replace_pattern(value, self.expand_one(old[len(anchor):]), self.expand_one(new),
                                   op == "//", anchor)
        if op in ("^^", "^"):
            return value.upper() if op == "^^" else value[:1].upper() + value[1:]
        return value.lower() if op == ",," else value[:1].lower() + value[1:]


def skip_quoted(word, at):
    """The index after the quoted part or expansion that starts at `at`, or None."""
    char = word[at]
    if char == "\\":
        return at + 2
    if char == "'":
        end = word.find("'", at + 1)
        return len(word) if end < 0 else end + 1
    if char == '"':
        return scan_double(word, at + 1)
    if char == "`":
        return scan_balanced(word, at + 1, "`")
    if word.startswith("$'", at):
        end = at + 2
        while end < len(word) and word[end] != "'":
            end += 2 if word[end] == "\\" else 1
        return end + 1
    if word.startswith(("$(", "${"), at):
        return scan_balanced(word, at + 2, ")" if word[at + 1] == "(" else "}")
    return None


BRACE_SEQUENCE_RE = re.compile(r"(-?[0-9]+|[A-Za-z])\.\.(-?[0-9]+|[A-Za-z])(?:\.\.(-?[0-9]+))?\Z")


def brace_expansion(word):
    """The words bash's brace expansion makes of a word: a{b,c}d, {1..3},
    {a..e..2}; braces quoted or in ${...} are text.  More than
    SH_MAX_LOOPS words are a value the reader cannot decide."""
    at = 0
    while at < len(word):
        skipped = skip_quoted(word, at)
        if skipped is not None:
            at = skipped
            continue
        items = brace_items(word, at) if word[at] == "{" else None
        if items is not None:
            end, items = items
            words = []
            for item in items:
                words.extend(brace_expansion(word[:at] + item + word[end:]))
                if len(words) > SH_MAX_LOOPS:
                    return [undecided(word)]
            return words
        at += 1
    return [word]


def brace_items(word, start):
    """(the index after the `}`, the items) of a brace expression opened at
    `start`, or None where bash leaves the braces as they are."""
    depth, commas, at = 0, [], start + 1
    while at < len(word):
        skipped = skip_quoted(word, at)
        if skipped is not None:
            at = skipped
            continue
        char = word[at]
        if char == "{":
            depth += 1
        elif char == "}" and depth:
            depth -= 1
        elif char == "}":
            bounds = [start] + commas + [at]
            if commas:
                return at + 1, [word[a + 1:b] for a, b in zip(bounds, bounds[1:])]
            return brace_sequence(word[start + 1:at], at + 1)
        elif char == "," and not depth:
            commas.append(at)
        at += 1
    return None


def brace_sequence(text, end):
    """{1..5}, {05..10..5}, {a..e}: (end, the items), or None."""
    match = BRACE_SEQUENCE_RE.match(text)
    if match is None:
        return None
    first, last, step = match.groups()
    step = abs(int(step or 1)) or 1
    if first.isalpha() != last.isalpha() or max(len(first), len(last)) > MAX_DIGITS:
        return None
    if first.isalpha():
        a, b = ord(first), ord(last)
        return end, [chr(c) for c in range(a, b + (1 if b >= a else -1), step if b >= a else -step)]
    a, b = int(first), int(last)
    if abs(b - a) // step > SH_MAX_LOOPS:
        return end, [undecided("{%s}" % text)]
    width = max(len(first), len(last)) if re.match(r"-?0[0-9]", first) or re.match(r"-?0[0-9]", last) else 0
    numbers = range(a, b + (1 if b >= a else -1), step if b >= a else -step)
    return end, ["%0*d" % (width, n) for n in numbers]


ANSI_C_ESCAPES = {"a": "\a", "b": "\b", "e": "\x1b", "E": "\x1b", "f": "\f", "n": "\n", "r": "\r",
                  "t": "\t", "v": "\v", "\\": "\\", "'": "'", '"': '"', "?": "?"}
ANSI_C_RE = re.compile(r"\\(?:([abeEfnrtv\\'\"?])|([0-7]{1,3})|x([0-9a-fA-F]{1,2})|u([0-9a-fA-F]{1,4})"
                       r"|U([0-9a-fA-F]{1,8})|c(.))", re.S)


def ansi_c(text):
    """The text of $'...': backslash escapes as bash decodes them."""
    def decode(match):
        simple, octal, hex2, hex4, hex8, control = match.groups()
        if simple:
            return ANSI_C_ESCAPES[simple]
        if control:
            return chr(ord(control.upper()) ^ 0x40) if control != "?" else "\x7f"
        code = int(octal, 8) & 0xFF if octal else int(hex2 or hex4 or hex8, 16)
        return chr(code) if code < 0x110000 else match.group()
    return ANSI_C_RE.sub(decode, text)


def runs_compiler(text):
    """Whether shell text the reader does not follow runs a compiler that
    builds something (not `command -v nvcc`, `nvcc --version`)."""
    command = []
    for kind, word, _ in tokenize(text) + [("op", ";", 0)]:
        if kind == "word":
            command.append(word.strip("\"'"))
            continue
        if command and is_compiler_name(command[0]) and any(
                w in ("-c", "-shared", "--output-file") or w.startswith("-o") for w in command):
            return True
        command = []
    return False


def array_words(text):
    """The words of an array value's text (between its parentheses)."""
    return [token[1] for token in tokenize(text) if token[0] == "word"]



def printf_value(form, args):
    """What printf writes for a format whose only directive is %s (used
    again for the arguments left over); None for any other format."""
    if re.search(r"%[^s]|%\Z|\\", form):
        return None
    count = form.count("%s")
    if count == 0:
        return form
    written = []
    for at in range(0, max(len(args), 1), count):
        chunk = iter(args[at:at + count] + [""] * count)
        written.append(re.sub("%s", lambda _: next(chunk), form))
    return "".join(written)


def remove_pattern(value, pattern, op):
    """${v%pat}, ${v%%pat}, ${v#pat}, ${v##pat}: shell glob patterns."""
    if len(value) > 4096:
        return undecided("${...%s%s}" % (op, pattern))
    sizes = range(len(value) + 1)
    if op in ("%%", "##"):
        sizes = reversed(sizes)
    for size in sizes:
        if op.startswith("%"):
            if fnmatch.fnmatchcase(value[len(value) - size:], pattern):
                return value[:len(value) - size]
        elif fnmatch.fnmatchcase(value[:size], pattern):
            return value[size:]
    return value


def replace_pattern(value, old, new, every, anchor=""):
    """${v/old/new}, ${v//old/new}, and anchored at the start (#) or the end
    (%), for a literal `old` (a glob is given up)."""
    if any(c in old for c in "*?[") or "&" in new:  # bash 5.2 puts the match where & is
        return undecided("${...%s%s%s/%s}" % ("//" if every else "/", anchor, old, new))
    if anchor == "#":
        return new + value[len(old):] if value.startswith(old) else value
    if anchor == "%":
        return value[:len(value) - len(old)] + new if value.endswith(old) else value
    if not old:
        return value
    return value.replace(old, new) if every else value.replace(old, new, 1)


def test_expression(args):
    """The truth of `test`'s arguments in the default invocation; None
    when it depends on the machine (a file test) or an unknown value."""
    if not args:
        return False
    if args[0] == "!":
        result = test_expression(args[1:])
        return None if result is None else not result
    for joiner in ("-o", "||", "-a", "&&"):
        if joiner in args:
            split = args.index(joiner)
            left, right = test_expression(args[:split]), test_expression(args[split + 1:])
            if joiner in ("-o", "||"):
                return True if True in (left, right) else (None if None in (left, right) else False)
            return False if False in (left, right) else (None if None in (left, right) else True)
    if len(args) == 1:
        return non_empty(args[0])
    if len(args) == 2 and args[0] in ("-n", "-z"):
        result = non_empty(args[1])
        return result if args[0] == "-n" or result is None else not result
    if len(args) == 3:
        left, op, right = args
        if op in ("=", "==", "!="):
            if not (known(left) and known(right)) or OUT_DIR in left + right:
                return None
            return (left == right) == (op != "!=")
        if op in ("-eq", "-ne", "-lt", "-le", "-gt", "-ge"):
            try:
                a, b = int(left), int(right)
            except ValueError:
                return None
            return {"-eq": a == b, "-ne": a != b, "-lt": a < b, "-le": a <= b,
                    "-gt": a > b, "-ge": a >= b}[op]
    return None


def non_empty(value):
    """Whether a value is not empty; None when that depends on what the reader cannot know."""
    if SH_LABEL_RE.sub("", value):
        return True
    return None if not known(value) else False


def describe_node(node):
    """A condition as a message shows it: its first simple command."""
    if type(node) is Group and node.subshell and node.body:
        return "( %s )" % describe_node(node.body[0])
    while node is not None and type(node) is not Simple:
        node = node.first if type(node) is AndOr else (
            node.commands[0] if type(node) is Pipeline else None)
    return " ".join(node.words)[:60] if node is not None else "a condition"


SH_BUILTINS = {
    ":": ScriptReader.builtin_true, "true": ScriptReader.builtin_true,
    "false": ScriptReader.builtin_true,
    "[": ScriptReader.builtin_test, "[[": ScriptReader.builtin_test, "test": ScriptReader.builtin_test,
    "command": ScriptReader.builtin_lookup, "which": ScriptReader.builtin_lookup,
    "type": ScriptReader.builtin_lookup, "hash": ScriptReader.builtin_lookup,
    "shift": ScriptReader.builtin_shift, "set": ScriptReader.builtin_set,
    "unset": ScriptReader.builtin_unset, "cd": ScriptReader.builtin_cd,
    "pushd": ScriptReader.builtin_cd, "popd": ScriptReader.builtin_cd,
    "exit": ScriptReader.builtin_exit, "return": ScriptReader.builtin_exit,
    "break": ScriptReader.builtin_loop, "continue": ScriptReader.builtin_loop,
    ".": ScriptReader.builtin_source, "source": ScriptReader.builtin_source,
    "read": ScriptReader.builtin_read, "getopts": ScriptReader.builtin_read,
    "mapfile": ScriptReader.builtin_read, "readarray": ScriptReader.builtin_read,
    "eval": ScriptReader.builtin_eval, "trap": ScriptReader.builtin_trap, "printf": ScriptReader.builtin_printf,
    "shopt": ScriptReader.builtin_shopt, "alias": ScriptReader.builtin_alias,
    "unalias": ScriptReader.builtin_alias,
    "let": ScriptReader.builtin_let, "cp": ScriptReader.builtin_place,
    "mv": ScriptReader.builtin_place, "ln": ScriptReader.builtin_place,
    "install": ScriptReader.builtin_place, "rm": ScriptReader.builtin_place,
}


# ---------------------------------------------------------------------------
# The manifest's rules


class Rule:
    """What a manifest value must be: a test, and the words that say it.
    `each` is the rule of every item of a list, or, as a dict, of every
    value of an object (by key, None for any other key); the items are
    reported one by one."""

    __slots__ = ("expected", "test", "each")

    def __init__(self, expected, test, each=None):
        self.expected = expected
        self.test = test
        self.each = each


def is_path(value):
    return type(value) is str and value != "" and normalize_relpath(value)[1] not in (
        NUL_PROBLEM, SURROGATE_PROBLEM)


def is_architecture(value):
    return (type(value) is str and value != "") or type(value) is int


def is_architecture_list(value):
    return (type(value) is list and value != [] and all(map(is_architecture, value))
            and len({str(a) for a in value}) == len(value))


def is_model_dir(model):
    return (is_path(model) and model.endswith("/") and inside_repository(model)
            and model.strip("/.") != "")


def is_tolerance(value):
    return type(value) in (int, float) and 0 <= value < float("inf")


STRING = Rule("a string", lambda v: type(v) is str)
NAME = Rule("a string of lowercase letters, digits and _", lambda v: type(v) is str and bool(NAME_RE.match(v)))
PATH = Rule("a non-empty path (no NUL character, valid UTF-8)", is_path)
POSITIVE = Rule("an integer >= 1", lambda v: type(v) is int and v >= 1)
ARCHITECTURE = Rule("an architecture (string or integer)", is_architecture)
REASON = Rule("a non-empty string saying why the warning is accepted",
              lambda v: type(v) is str and v.strip() != "")

# Every key of a manifest: (key, required, rule).  check_keys applies these
# rules and words its messages from them, load() takes the values it uses
# through them, and backends/backend.schema.json says the same for editors
# (a test proves that the schema agrees).
MANIFEST_KEYS = (
    ("$schema", False, STRING),
    ("name", True, NAME),
    ("platform", False, STRING),
    ("description", False, STRING),
    ("abi_version", True, POSITIVE),
    ("status", True, Rule("one of %s" % ", ".join(STATUSES), lambda v: type(v) is str and v in STATUSES)),
    ("sources", True, Rule("a non-empty list of paths", lambda v: type(v) is list and v != [], PATH)),
    ("build", True, Rule("an object with script, output and architectures", lambda v: type(v) is dict)),
    ("build.script", True, PATH),
    ("build.output", True, PATH),
    ("build.architectures", True, Rule("a non-empty list of architectures, without duplicates",
                                       is_architecture_list)),
    ("build.default_arch", False, ARCHITECTURE),
    ("build.min_capability", False, POSITIVE),
    ("models", False, Rule("a list of repository-relative directories ending in /",
                           lambda v: type(v) is list,
                           Rule("a directory relative to the repository root, inside it, ending in /",
                                is_model_dir))),
    ("numerics", False, Rule("an object with precision, accumulation and tolerance",
                             lambda v: type(v) is dict)),
    ("numerics.precision", False, STRING),
    ("numerics.accumulation", False, STRING),
    ("numerics.tolerance", False, Rule("an object mapping op names to numbers", lambda v: type(v) is dict,
                                       {"note": STRING, None: Rule("a finite number >= 0", is_tolerance)})),
    ("reference", False, Rule("an object with entrypoint and note", lambda v: type(v) is dict)),
    ("reference.entrypoint", False, PATH),
    ("reference.note", False, Rule("a non-empty string", lambda v: type(v) is str and v != "")),
    ("excluded", False, Rule("a list of glob patterns", lambda v: type(v) is list, PATH)),
    ("ignore", False, Rule("an object mapping codes to reasons", lambda v: type(v) is dict,
                           {None: REASON})),
)


def keys_by_object(table):
    """The table by the object that holds each key:
    {"": {"name": (required, rule), ...}, "build.": {"script": ...}, ...}."""
    below = {}
    for key, required, rule in table:
        where, _, name = key.rpartition(".")
        below.setdefault(where + "." if where else "", {})[name] = (required, rule)
    return below


KEYS_BELOW = keys_by_object(MANIFEST_KEYS)


# ---------------------------------------------------------------------------
# Discovery


def discover(repo):
    """(backends, diagnostics): every backend directory with a manifest, and the
    findings about directories that should have one."""
    backends, diagnostics = [], []
    groups = candidate_dirs(repo)
    diagnostics.extend(repo.unlisted)
    for platform, candidates, strays in groups:
        found = [classify(repo, backend) for backend in candidates]
        if not add_platform(repo, platform, found, strays, diagnostics):
            continue
        diagnostics.extend(strays)
        for backend, (is_backend, _, loose) in zip(candidates, found):
            diagnostics.extend(loose)
            if is_backend:
                backends.append(backend)
    return backends, diagnostics


def candidate_dirs(repo):
    """[(platform, [Backend], [D005 findings])]: every directory below a
    platform directory, sorted, not yet walked, and the kernel sources lying
    directly in the platform directory, which belong to no backend.  The
    directories that cannot be listed, or lead out of the repository, are in
    repo.unlisted afterwards."""
    groups = []
    repo.unlisted = []
    top_entries = sorted(listed_dirs(repo, repo.backends_path, repo.backends_dir, repo.backends_dir),
                         key=lambda e: e[0].name)
    for platform_entry, _ in top_entries:
        platform = platform_entry.name
        platform_rel = repo_path(repo.backends_dir, platform)
        entries = sorted(listed_dirs(repo, platform_entry.path, platform_rel, platform, files=True),
                         key=lambda e: e[0].name)
        directories = {child.name for child, is_dir in entries if is_dir}
        flats = [flat_backend(platform, platform_entry.path, platform_rel, child)
                 for child, is_dir in entries if not is_dir and child.name.endswith(MANIFEST_SUFFIX)
                 and child.name[:-len(MANIFEST_SUFFIX)] not in directories]
        owned = {d for flat in flats for d in flat.owned}
        candidates, strays = list(flats), []
        for child, is_dir in entries:
            rel = platform_rel + "/" + child.name
            if is_dir and child.name not in owned:
                candidates.append(Backend(child.name, platform, child.path, rel))
            elif is_dir or flats:
                continue  # a flat backend's: its own directory, its loose sources
            elif child.name.endswith(MANIFEST_SUFFIX):
                name = child.name[:-len(MANIFEST_SUFFIX)]
                strays.append(Diagnostic(
                    "error", "D002", platform, rel, None,
                    "manifest %s is never discovered: a backend is a directory %s/<name>/ holding "
                    "<name>%s; move it to %s/%s/%s" % (child.name, platform_rel, MANIFEST_SUFFIX,
                                                       platform_rel, name, child.name)))
            elif is_kernel_source(child.name):
                strays.append(Diagnostic(
                    "error", "D005", platform, rel, None,
                    "kernel source %s lies directly in the platform directory, where it belongs "
                    "to no backend; move it into a backend directory %s/<name>/"
                    % (child.name, platform_rel)))
        groups.append((platform, candidates, strays))
    return groups


def flat_backend(platform, path, rel, manifest):
    """The backend of a manifest directly in a platform directory: its
    sources are relative to the platform directory, and it owns the
    directories they (and its build script) are in."""
    backend = Backend(manifest.name[:-len(MANIFEST_SUFFIX)], platform, path, rel)
    data = read_text(manifest.path, regular=True)[0]
    try:
        m = json.loads(data) if data is not None else {}
    except (ValueError, RecursionError):  # load() reports it
        m = {}
    m = m if isinstance(m, dict) else {}
    build = m.get("build") if isinstance(m.get("build"), dict) else {}
    paths = (m.get("sources") if isinstance(m.get("sources"), list) else []) + [build.get("script")]
    backend.owned = {normalize_relpath(p)[0].split("/")[0] for p in paths
                     if isinstance(p, str) and "/" in (normalize_relpath(p)[0] or "")}
    return backend


def repo_path(directory, name):
    """A repository-relative path below a directory ("." for the root)."""
    return name if directory == "." else directory + "/" + name


def listed_dirs(repo, path, rel, key, files=False):
    """[(entry, is_dir)] of a directory: its subdirectories, and with
    `files` its other entries too, leaving out hidden entries, those git
    ignores, and directories that lead out of the repository (a D006
    finding; such a link is never followed).  A directory that cannot be
    listed is a D004 finding."""
    ignored = ignore_function(repo, path)
    found = []
    try:
        with os.scandir(path) as entries:
            for entry in entries:
                # In a platform directory (`files`), a hidden directory is seen:
                # a build compiles backends/cpu/.wip/x.c as well as any other.
                if entry.name in SKIPPED_DIRS or (entry.name.startswith(".") and not files):
                    continue
                is_dir = _is_dir(entry)
                if ignored and ignored(entry.name + ("/" if is_dir else "")):
                    continue
                if is_dir and entry.is_symlink() and not repo.inside(entry.path):
                    repo.unlisted.append(Diagnostic(
                        "error", "D006", repo_path(key, entry.name) if files else entry.name,
                        repo_path(rel, entry.name), None,
                        "directory %s is a symbolic link to %s, outside the repository; the check "
                        "does not follow it (replace the link with the directory it stands for)"
                        % (repo_path(rel, entry.name), os.path.realpath(entry.path))))
                    continue
                if is_dir or files:
                    found.append((entry, is_dir))
    except OSError as exc:
        repo.unlisted.append(unlisted_directory(key, rel, exc.strerror or str(exc)))
    return found


def ignore_function(repo, directory):
    """A function telling whether git ignores a path relative to a
    directory (a directory's ending in /), or None when git ignores nothing
    there or is not at hand."""
    if repo.git is None or not repo.git.ignored_paths():
        return None
    rel = os.path.relpath(os.path.realpath(directory), repo.git.top).replace(os.sep, "/")
    if rel == ".." or rel.startswith("../"):
        return None
    prefix = "" if rel == "." else rel + "/"
    if repo.git.ignores(prefix):
        return lambda path: True
    return lambda path: repo.git.ignores(prefix + path)


def classify(repo, backend):
    """Walk a candidate directory: (whether it is a backend, whether it has a
    manifest or kernel sources at all, its discovery findings)."""
    unlisted = []
    ignored = ignore_function(repo, backend.dir)
    if backend.owned is not None:  # a flat backend: its files, and its directories' only
        def ignored(path, git=ignored, owned=backend.owned):
            return (path.endswith("/") and path.count("/") == 1 and path[:-1] not in owned) or (
                git is not None and git(path))
    backend.files = files = walk_files(backend.dir, unlisted, ignored)
    manifest_name = backend.name + MANIFEST_SUFFIX
    has_manifest = manifest_name in files
    relevant = has_manifest or any(p.endswith(KERNEL_SUFFIXES) for p in files)
    diagnostics = []
    for rel, reason in unlisted:
        relevant = True
        diagnostics.append(unlisted_directory(
            backend.key, backend.rel(rel) if rel else backend.rel_dir, reason))
    # A manifest under another name: <other>.backend.json, or the likely
    # slips backend.json and <name>.json.
    slips = ("backend.json", backend.name + ".json")
    stray = [p for p in files if p != manifest_name and (p.endswith(MANIFEST_SUFFIX) or p in slips)
             and not (backend.owned is not None and "/" not in p and p.endswith(MANIFEST_SUFFIX))]
    for name in stray:
        if "/" not in name:
            where = "the manifest of directory %s must be named %s" % (backend.name, manifest_name)
        else:  # a manifest counts only directly in <platform>/<name>/, named after <name>
            where = ("a backend is a directory %s/<name>/ holding <name>%s; move %s/ there"
                     % (posixpath.dirname(backend.rel_dir), MANIFEST_SUFFIX,
                        backend.rel(posixpath.dirname(name))))
        diagnostics.append(Diagnostic(
            "error", "D002", backend.key, backend.rel(name), None,
            "manifest %s is never discovered: %s" % (name, where)))
    if has_manifest or os.path.lexists(backend.manifest_path):
        return True, relevant, diagnostics
    if backend.name in ("test", "tests"):  # a platform's own tests, with their fixtures
        return False, relevant, diagnostics
    kernels = sorted(p for p in files if is_kernel_source(p))
    if kernels and not stray and backend.name.startswith("."):
        diagnostics.append(Diagnostic(
            "error", "D001", backend.key, backend.rel_dir, None,
            "is a hidden directory with kernel sources (%s) that no manifest declares, which a "
            "build can still compile; move them into a backend directory, or out of the backends "
            "directory" % ", ".join(kernels[:3])))
    elif kernels and not stray:
        diagnostics.append(Diagnostic(
            "error", "D001", backend.key, backend.rel_dir, None,
            "has kernel sources (%s) but no %s manifest; run: python3 check_contract.py init %s"
            % (", ".join(kernels[:3]), manifest_name, backend.rel_dir)))
    return False, relevant, diagnostics


def unlisted_directory(key, rel_dir, reason):
    return Diagnostic("error", "D004", key, rel_dir, None,
                      "cannot list directory %s: %s; the check cannot see what it holds (make it "
                      "readable, or move it out of the backends directory)" % (rel_dir, reason))


def add_platform(repo, platform, found, strays, diagnostics):
    """Whether the candidates of a platform directory count (those of an
    unknown platform only when one has a manifest or kernel sources, or
    kernel sources lie in the platform directory itself, and then with a
    warning); `found` holds classify()'s answer for each."""
    if platform in PLATFORMS:
        return True
    if not strays and not any(answer[1] for answer in found):
        return False
    diagnostics.append(Diagnostic(
        "warning", "D003", platform, repo_path(repo.backends_dir, platform), None,
        'unknown platform directory "%s"; only platform-independent checks run '
        "(known platforms: %s)" % (platform, ", ".join(PLATFORMS))))
    return True


def _is_dir(entry):
    try:
        return entry.is_dir()
    except OSError:
        return False


# ---------------------------------------------------------------------------
# Loading a manifest


class ManifestDecoder(json.JSONDecoder):
    """A JSON decoder that notes duplicate keys (plain json keeps the last
    silently).  One instance serves the whole run: building a decoder per
    manifest costs more than decoding it."""

    def __init__(self):
        self.duplicates = []
        super().__init__(object_pairs_hook=self.pairs, parse_int=self.integer)

    @staticmethod
    def integer(digits):
        """An integer of the manifest; one too long for any manifest value
        is refused here, alike on every Python (3.11 and later refuse over
        4,300 digits themselves, 3.9 reads any length)."""
        if len(digits.lstrip("-")) > MAX_DIGITS:
            raise ValueError("too many digits")
        return int(digits)

    def pairs(self, items):
        seen = dict(items)
        if len(seen) != len(items):
            keys = set()
            for key, _ in items:
                if key in keys:
                    self.duplicates.append(key)
                keys.add(key)
        return seen


MANIFEST_DECODER = ManifestDecoder()
JSON_SPACE_RE = re.compile(r"[ \t\n\r]*")
JSON_SCALAR_RE = re.compile(r"[^,\]} \t\n\r]+")


def manifest_lines(text):
    """{key: line} of the keys and list items of a manifest that decoded,
    named as the messages name them ("build.output", "sources[1]",
    "numerics.tolerance.rmsnorm_f32"); of a duplicate key, the last, the
    one JSON keeps."""
    import bisect
    from json.decoder import scanstring
    starts = [0] + [m.end() for m in re.finditer("\n", text)]
    lines = {}

    def value(pos, place):
        """Note the lines below the value at pos; the position after it."""
        pos = JSON_SPACE_RE.match(text, pos).end()
        if text[pos] not in "{[":
            return scanstring(text, pos + 1)[1] if text[pos] == '"' else JSON_SCALAR_RE.match(
                text, pos).end()
        close, index = "}" if text[pos] == "{" else "]", 0
        pos = JSON_SPACE_RE.match(text, pos + 1).end()
        while text[pos] != close:
            if close == "}":
                key, pos = scanstring(text, pos + 1)
                inner = place + "." + key if place else key
                lines[inner] = bisect.bisect_right(starts, pos)
                pos = JSON_SPACE_RE.match(text, pos).end() + 1  # the colon
            else:
                inner = "%s[%d]" % (place, index)
                pos = JSON_SPACE_RE.match(text, pos).end()
                lines[inner] = bisect.bisect_right(starts, pos)
                index += 1
            pos = JSON_SPACE_RE.match(text, value(pos, inner)).end()
            if text[pos] == ",":
                pos = JSON_SPACE_RE.match(text, pos + 1).end()
        return pos + 1

    try:
        value(0, "")
    except RecursionError:  # nested deeper than any manifest: the lines found so far
        pass
    return lines


def load(backend):
    """Read and parse the manifest; fill the record with the fields it gives."""
    rel = backend.rel(backend.name + MANIFEST_SUFFIX)
    text, problem, bad_byte = read_text(backend.manifest_path,
                                        backend.files.get(backend.name + MANIFEST_SUFFIX) == "file")
    if text is None:
        backend.error("J004", "cannot read %s: %s" % (backend.name + MANIFEST_SUFFIX, problem), rel)
        return
    if bad_byte is not None:
        backend.error("J004", "%s is not UTF-8 (first bad byte at offset %d); save it as UTF-8"
                      % (backend.name + MANIFEST_SUFFIX, bad_byte), rel)
        return
    if text.startswith("\ufeff"):
        backend.error("J001", "%s starts with a byte-order mark, which JSON does not allow; save "
                      "it as UTF-8 without one" % (backend.name + MANIFEST_SUFFIX), rel, 1)
        return
    duplicates = MANIFEST_DECODER.duplicates
    del duplicates[:]
    try:
        manifest = MANIFEST_DECODER.decode(text)
    except ValueError as exc:
        line, column = getattr(exc, "lineno", None), getattr(exc, "colno", None)
        if line is None:  # valid JSON, but a number with more digits than int() reads
            backend.error("J001", "a number in %s has too many digits to read; no manifest value "
                          "needs that many" % (backend.name + MANIFEST_SUFFIX), rel)
            return
        message = getattr(exc, "msg", str(exc))
        backend.error("J001", "invalid JSON at line %s, column %s: %s" % (line, column, message),
                      rel, line)
        return
    except RecursionError:
        backend.error("J001", "invalid JSON: nested too deeply", rel)
        return
    for key in sorted(set(duplicates)) if duplicates else ():
        backend.error("J002", 'duplicate key "%s"; JSON keeps only the last value, remove the '
                      "others" % key, rel)
    if not isinstance(manifest, dict):
        backend.error("J003", "the manifest must be a JSON object, not %s" % describe(manifest), rel)
        return
    backend.manifest_text = text
    take_manifest(backend, manifest)


def take_manifest(backend, manifest):
    """Fill the record with the fields a parsed manifest gives."""
    backend.manifest = manifest
    rules = {key: rule for key, _, rule in MANIFEST_KEYS}
    if rules["status"].test(manifest.get("status")):
        backend.status = manifest["status"]
    if rules["abi_version"].test(manifest.get("abi_version")):
        backend.abi_version = manifest["abi_version"]
    sources = manifest.get("sources")
    if type(sources) is list:
        backend.sources = [(source,) + normalize_relpath(source) for source in sources if is_path(source)]
    build = manifest.get("build")
    if type(build) is dict:
        if is_path(build.get("script")):
            backend.build_script, _ = normalize_relpath(build["script"])
        if is_path(build.get("output")):
            backend.output = build["output"]
        archs = build.get("architectures")
        if type(archs) is list and archs and all(map(is_architecture, archs)):
            backend.architectures = [str(a) for a in archs]
        if is_architecture(build.get("default_arch")):
            backend.default_arch = str(build["default_arch"])
    ignore = manifest.get("ignore")
    if type(ignore) is dict:
        backend.ignore = {code: why for code, why in ignore.items()
                          if CODE_RE.match(code) and REASON.test(why)}


# ---------------------------------------------------------------------------
# Checks.  Each takes (repo, backend) and reports on the backend.  They run
# in table order; `planned` backends get only the manifest and ABI checks.


def check_keys(repo, backend):
    """M001-M005: required keys, types and values of the manifest, as
    MANIFEST_KEYS gives them."""
    rel = backend.rel(backend.name + MANIFEST_SUFFIX)
    check_object(backend, rel, backend.manifest, "")
    m = backend.manifest
    name, platform = m.get("name"), m.get("platform")
    if NAME.test(name) and name != backend.name:
        backend.error("M004", 'name "%s" differs from its %s "%s"; they must be equal'
                      % (name, "directory" if backend.owned is None else "manifest's file name",
                         backend.name), rel, key="name")
    if STRING.test(platform) and platform != backend.platform:
        backend.error("M005", 'platform "%s" differs from its directory "%s"'
                      % (platform, backend.platform), rel, key="platform")
    ignore = m.get("ignore")
    for code in sorted(ignore) if type(ignore) is dict else ():
        if not CODE_RE.match(code):
            backend.error("M002", '"ignore" maps codes to reasons; "%s" is no code (a letter and '
                          "three digits, as B017)" % code, rel, key="ignore." + code)
    build = m.get("build")
    if type(build) is dict and backend.architectures is not None:
        form = ARCH_FORMS.get(backend.platform)
        for index, arch in enumerate(backend.architectures) if form else ():
            if not form[0].match(arch):
                backend.error("B011", "architecture %s is not %s" % (describe(arch), form[1]), rel,
                              key="build.architectures[%d]" % index)


def check_object(backend, rel, value, where):
    """Report what breaks the rules of the keys below `where` ("" for the
    top level, "build." ...) in an object of the manifest."""
    rules = KEYS_BELOW[where]
    for key in sorted(value) if not rules.keys() >= value.keys() else ():
        if key not in rules:
            backend.warning("M003", 'unknown key "%s%s"%s' % (where, key, unknown_key_hint(
                where, key, rules)), rel, key=where + key)
    for name, (required, rule) in rules.items():
        if name not in value:
            if required:
                backend.error("M001", 'missing required key "%s%s"' % (where, name), rel,
                              key=where[:-1] or None)
            continue
        item = value[name]
        if not rule.test(item):
            backend.error("M002", '"%s%s" must be %s, not %s'
                          % (where, name, rule.expected, describe(item)), rel, key=where + name)
        elif rule.each is not None:
            for index, element in (sorted(item.items()) if type(item) is dict else enumerate(item)):
                each = rule.each.get(index, rule.each[None]) if type(item) is dict else rule.each
                if not each.test(element):
                    place = ("%s%s.%s" if type(item) is dict else "%s%s[%d]") % (where, name, index)
                    backend.error("M002", '"%s" must be %s, not %s'
                                  % (place, each.expected, describe(element)), rel, key=place)
        elif type(item) is dict and where + name + "." in KEYS_BELOW:
            check_object(backend, rel, item, where + name + ".")


def unknown_key_hint(where, key, rules):
    """What to say of an unknown key: where it belongs when another object
    of the manifest has it (a top-level min_capability belongs in build),
    else the nearest spelling."""
    homes = sorted(place + key for place, names in KEYS_BELOW.items() if key in names)
    if homes:
        return "; it belongs %s" % " or ".join(
            'under "%s" (as "%s")' % (home.rsplit(".", 1)[0], home) if "." in home else
            'at the top level (as "%s")' % home for home in homes)
    hint = nearest(key, list(rules))
    return '; did you mean "%s"?' % hint if hint else ""


def check_abi(repo, backend):
    """A001-A005: the ABI version macro in the declared sources."""
    if type((backend.manifest or {}).get("sources")) is not list:
        return
    sources = AbiSources(backend)
    own = sources.own_prefixes()
    defines = [d for d in sources.defines() if d[2] in own]
    for rel, line, prefix, value, raw in defines:
        if value is None:
            backend.error("A005", "%s defines %s_ABI_VERSION as %s, not an integer literal"
                          % (rel, prefix, describe(raw)), backend.rel(rel), line)
    literal = [d for d in defines if d[3] is not None]
    if not literal:
        if not defines:  # with one, A005 said what is wrong with the macro there is
            level = "error" if backend.status == "validated" else "warning"
            backend.report(level, "A003", "no #define <PREFIX>_ABI_VERSION in the declared sources; "
                           "add one equal to abi_version")
        # The prefix from the macro there is, else from the <prefix>_abi_version() declared.
        prefixes = {defines[0][2].lower()} if defines else sources.abi_function_prefixes()
        if not prefixes:
            backend.warning("A004", "no declaration of a <prefix>_abi_version() in the declared "
                            "sources; the C ABI requires it, and <prefix>_error_string()")
        for prefix in sorted(prefixes):
            check_abi_functions(backend, sources, prefix)
        return
    values = {d[3] for d in literal}
    backend.abi_prefix = literal[0][2].lower()
    if len(values) > 1:
        places = ", ".join("%s:%d defines %s_ABI_VERSION %d" % (rel, line, prefix, value)
                           for rel, line, prefix, value, _ in literal)
        rel, line = literal[0][0], literal[0][1]
        backend.error("A002", "several ABI versions are defined (%s); keep exactly one" % places,
                      backend.rel(rel), line)
    elif backend.abi_version is not None and literal[0][3] != backend.abi_version:
        rel, line, prefix, value, _ = literal[0]
        backend.error("A001", "abi_version is %d but %s defines %s_ABI_VERSION %d (line %d); "
                      "make them equal" % (backend.abi_version, rel, prefix, value, line),
                      backend.rel(rel), line)
    check_abi_functions(backend, sources, backend.abi_prefix)


def check_abi_functions(backend, sources, prefix):
    """A004: the two functions every ABI declares."""
    for symbol in (prefix + "_abi_version", prefix + "_error_string"):
        if not sources.declares(symbol):
            backend.warning("A004", "no declaration of %s() in the declared sources; the C ABI "
                            "requires it" % symbol)


class AbiSources:
    """The declared sources of a backend as the preprocessor meets them: in
    the manifest's order, each quoted #include of a source that names an ABI
    macro read where it stands (once), so that an #undef and a new #define
    replace what came before in include order."""

    def __init__(self, backend):
        self.backend = backend
        self.texts = {}    # rel -> [text, live text or None]
        self.events = []   # (rel, event) in include order
        declared = [rel for _, rel, problem in backend.sources
                    if not problem and rel.endswith(KERNEL_SUFFIXES)]
        # The paths check_sources rejected, looked up once per source, not searched for.
        rejected = {d.path for d in backend.diagnostics if d.code[0] == "S"}
        for rel in declared:
            if rel not in self.texts:
                self.read(rel, read_source(backend, rel, rejected))

    def read(self, rel, text):
        self.texts[rel] = entry = [text or "", None]
        if text is None or ("_ABI_VERSION" not in text and "#undef" not in text):
            return
        entry[1], directives = preprocess(text)
        for event in macro_events(directives):
            if event[0] != "include":
                self.events.append((rel, event))
                continue
            for candidate in (posixpath.join(posixpath.dirname(rel), event[2]), event[2]):
                included, problem = normalize_relpath(posixpath.normpath(candidate))
                if problem is None and included not in self.texts and (
                        self.backend.files.get(included) == "file"):
                    data, _, _ = read_bytes(self.backend.dir + "/" + included, True)
                    self.read(included, None if data is None else decode(data)[0])
                    break

    def defines(self):
        """[(rel, line, prefix, value or None, raw)] of the definitions in
        force at the end, an #undef dropping the earlier ones."""
        found = []
        for rel, event in self.events:
            if event[0] == "define":
                found.append((rel, event[1], event[2], event[3], event[4]))
            else:
                found = [d for d in found if d[2] != event[2]]
        return found

    def own_prefixes(self):
        """The prefixes of the backend's own ABI: those whose
        <prefix>_abi_version() the sources declare; all when none is (a
        vendored header's macro, such as DLPACK_ABI_VERSION, is not the
        backend's ABI)."""
        prefixes = {d[2] for d in self.defines()}
        declared = {p for p in prefixes if self.declares(p.lower() + "_abi_version")}
        return declared or prefixes

    def abi_function_prefixes(self):
        """The prefixes of every <prefix>_abi_version( the sources name."""
        found = set()
        for entry in self.texts.values():
            if "_abi_version" in entry[0]:
                if entry[1] is None:
                    entry[1] = preprocess(entry[0])[0]
                found.update(ABI_FUNCTION_RE.findall(entry[1]))
        return found

    def declares(self, symbol):
        """Whether a source names `symbol(` in its live text."""
        for entry in self.texts.values():
            if symbol not in entry[0]:
                continue
            if entry[1] is None:
                entry[1] = preprocess(entry[0])[0]
            text = entry[1]
            start = text.find(symbol)
            while start >= 0:
                end = start + len(symbol)
                before = text[start - 1] if start else " "
                if not (before.isalnum() or before == "_") and C_CALL_RE.match(text, end):
                    return True
                start = text.find(symbol, end)
        return False


def read_source(backend, rel, rejected):
    """Text of a declared source, or None when it cannot be read (S005; a
    missing one is S001, or not yet written when planned).  A source that
    check_sources rejected (its path in `rejected`: outside the directory,
    not a regular file) is not read."""
    path = backend.rel(rel)
    regular = backend.files.get(rel) == "file"
    if not regular and path in rejected:
        return None
    data, problem, _ = read_bytes(backend.dir + "/" + rel, regular)
    if data is None:
        if os.path.lexists(backend.dir + "/" + rel):  # a missing one is S001, or planned
            backend.error("S005", "source %s cannot be read: %s" % (rel, problem), path)
        return None
    text, bad_byte = decode(data)
    if bad_byte is not None:
        backend.warning("S006", "%s is not UTF-8 (first bad byte at offset %d)" % (rel, bad_byte),
                        backend.rel(rel))
    return text


def check_sources(repo, backend):
    """S001-S005: declared sources exist inside the directory; none is missing."""
    m = backend.manifest
    if type(m.get("sources")) is not list:
        return
    declared = {}
    real_dir = None
    at = {}  # each source's places in the list, for the line of a finding about the entry
    for index, source in enumerate(m["sources"]):
        if type(source) is str:
            at.setdefault(source, []).append(index)
    for source, rel, problem in backend.sources:
        key = "sources[%d]" % at[source].pop(0)
        if problem:
            backend.error("S002", "source %s %s" % (describe(source), problem), key=key)
            continue
        if rel in declared:
            backend.error("S003", "source %s is listed twice (as %s and %s)"
                          % (rel, describe(declared[rel]), describe(source)), key=key)
            continue
        declared[rel] = source
        kind = backend.files.get(rel)
        if kind == "file":
            continue
        if kind == "other":
            backend.error("S005", "source %s is not a regular file" % rel, backend.rel(rel))
            continue
        path = os.path.join(backend.dir, rel)
        if not os.path.lexists(path):
            backend.error("S001", "source %s does not exist" % rel, backend.rel(rel))
            continue
        if real_dir is None:
            real_dir = os.path.realpath(backend.dir)
        real = os.path.realpath(path)
        if not (real + "/").startswith(real_dir + "/"):
            backend.error("S002", "source %s is a symbolic link that resolves outside the backend "
                          "directory" % rel, backend.rel(rel))
            continue
        try:
            regular = stat.S_ISREG(os.stat(path).st_mode)
        except OSError as exc:
            backend.error("S005", "source %s cannot be read: %s" % (rel, exc.strerror or exc),
                          backend.rel(rel))
            continue
        if not regular:
            backend.error("S005", "source %s is not a regular file" % rel, backend.rel(rel))
    excluded = m.get("excluded")
    excluded = [g for g in excluded if isinstance(g, str)] if isinstance(excluded, list) else []
    for path, kind in backend.files.items():  # the report is sorted: no need to sort here
        if kind == "link" and path not in declared:
            check_linked_directory(backend, path, excluded)
        if path in declared or not path.endswith(KERNEL_SUFFIXES):
            continue
        parts = path.split("/")
        if parts[-1].startswith("test_") or "tests" in parts[:-1]:
            continue
        if any(glob_matches(g, path) for g in excluded):
            continue
        backend.error("S004", "kernel source %s is not declared in sources; add it, or list it "
                      "in excluded if it is not part of the library" % path, backend.rel(path))


def check_linked_directory(backend, path, excluded):
    """S007: a link to a directory outside the backend directory, which the
    walk does not follow but a build could compile from."""
    full = backend.dir + "/" + path
    if not os.path.isdir(full) or any(glob_matches(g, path) for g in excluded):
        return
    real, real_dir = os.path.realpath(full), os.path.realpath(backend.dir)
    if real == real_dir or real.startswith(real_dir.rstrip("/") + "/"):
        return
    backend.error("S007", "%s is a link to the directory %s, outside the backend directory, whose "
                  "files the check does not see; move them into the backend directory, or list %s "
                  "in excluded if the build does not use them" % (path, real, path),
                  backend.rel(path))


def check_build_script(repo, backend):
    """B001-B012: the build script, its output and the architectures it builds."""
    m = backend.manifest
    build = m.get("build")
    if not isinstance(build, dict):
        return
    check_build_targets(backend, build)
    if not check_build_output(backend) or not isinstance(build.get("script"), str):
        return
    script = build["script"]
    rel, problem = normalize_relpath(script)
    rel_path = backend.rel(rel) if rel else None
    if problem:
        backend.error("S002", "build.script %s %s" % (describe(script), problem), key="build.script")
        return
    path = backend.dir + "/" + rel
    if backend.files.get(rel) == "link" and not repo.inside(path):
        backend.error("S002", "build script %s is a symbolic link to %s, outside the repository; "
                      "keep it in the repository, where CI and the trace run it"
                      % (rel, os.path.realpath(path)), rel_path)
        return
    data, problem, mode = read_bytes(path)  # the mode comes with the read
    if mode is None:
        try:
            mode = os.stat(path).st_mode
        except OSError:
            backend.error("B001", "build script %s does not exist" % rel, rel_path)
            return
    if not stat.S_ISREG(mode):
        backend.error("B001", "build script %s is not a regular file" % rel, rel_path)
        return
    if not mode & 0o111:
        backend.error("B002", "build script %s is not executable; run: chmod +x %s"
                      % (rel, rel_path), rel_path)
    backend.index_path = rel_path  # check_index_modes() looks it up in the git index
    if data is None:
        backend.error("B001", "build script %s cannot be read: %s" % (rel, problem), rel_path)
        return
    if b"\r\n" in data:
        backend.error("B012", "build script %s has Windows (CRLF) line ends, which bash reads as "
                      "part of each command; convert it (dos2unix %s), and if git converts it on "
                      "checkout, add '*.sh text eol=lf' to .gitattributes" % (rel, rel_path),
                      rel_path, data.count(b"\n", 0, data.index(b"\r\n")) + 1)
    text = decode(data)[0]
    check_shebang(backend, rel, text, rel_path)
    facts = ScriptReader(text, backend.dir, None if os.path.islink(path) else posixpath.dirname(rel)).facts()
    check_build_facts(backend, rel, facts)
    check_read_sources(repo, backend, rel, facts)


def check_read_sources(repo, backend, rel, facts):
    """S008, S009 from the reading: the files the compiler calls surely
    compile, placed as the build tier runs the script (from the repository
    root, $0 its path there, links unresolved), against `sources`.  A file
    that is not there counts only where nothing run before could make it."""
    if any(line not in facts.programs for line, _ in facts.unfollowed):
        return  # eval, a file it cannot source: what runs may not be what it read
    script = backend.rel(rel)
    here = posixpath.dirname(script)
    if os.path.islink(os.path.join(repo.root, script)) or \
            repo.real_directory(here) != os.path.join(repo.real_root, here):
        here = None
    calls, complete = [], not facts.unfollowed
    for call in facts.calls:
        complete = complete and not call.opaque
        if call.condition:
            complete = False
            continue
        found = CompilerCall(call.compiler, call.line)
        for raw in call.inputs:
            place = script_place(facts.script_dirs, raw)
            raw = raw if place is None else here and here + "/" + place
            # Known, no glob (what bash makes of it), and a directory read alike by name and
            # by the kernel (a link's .. is the target's parent).
            path = None if not raw or raw.startswith("/") or any(
                c in raw for c in MARKERS + ("*", "?", "[")) else posixpath.normpath(raw)
            if path:
                directory = posixpath.dirname(path)
                if ".." in raw.split("/") or raw.endswith("/"):  # as the kernel resolves it
                    named = os.path.join(repo.root, posixpath.dirname(raw))
                    real = os.path.realpath(named) if os.path.isdir(named) or facts.made_directory \
                        else None  # nosuch/.. fails to open
                else:
                    real = repo.real_directory(directory)
                if real != os.path.normpath(os.path.join(repo.real_root, directory)):
                    path = None
            local = path[len(backend.rel_dir) + 1:] if path and path.startswith(backend.rel_dir + "/") else None
            if path is None or path.startswith("../") or (call.after_write and (
                    backend.files.get(local) != "file" if local is not None
                    else not os.path.isfile(os.path.join(repo.root, path)))):
                complete = False  # made by what ran before, maybe
            else:
                found.inputs.append(path)
        calls.append(found)
    check_compiled_sources(repo, backend, calls, lambda path: path, complete=complete)


# Where the interpreter of a `#!` line is on every Linux and macOS system.
STANDARD_INTERPRETERS = ("/bin/sh", "/bin/bash", "/bin/dash", "/bin/zsh", "/bin/ksh", "/usr/bin/env",
                         "/usr/bin/sh", "/usr/bin/bash", "/usr/bin/zsh")


def check_shebang(backend, rel, text, rel_path):
    """B014: `./build.sh` runs only with a #! line naming an interpreter that exists."""
    first = text.split("\n", 1)[0]
    if not first.startswith("#!"):
        backend.error("B014", "build script %s has no #! line, so ./%s cannot run; start it with "
                      "#!/usr/bin/env bash" % (rel, rel), rel_path, 1)
        return
    words = first[2:].split()
    if not words or words[0] not in STANDARD_INTERPRETERS or (words[0] == "/usr/bin/env"
                                                              and len(words) < 2):
        backend.error("B014", "build script %s starts with %s, an interpreter that is not on a "
                      "standard system, so ./%s cannot run; start it with #!/usr/bin/env bash"
                      % (rel, first.strip(), rel), rel_path, 1)


def check_build_output(backend):
    """B015: build.output names a file inside <output-dir>."""
    output = backend.output
    if output is None:
        return True
    if output.startswith("/") or ".." in output.split("/"):
        backend.error("B015", "build.output %s is not inside the build script's <output-dir>; give "
                      "the library's path relative to it, e.g. %s"
                      % (describe(output), describe(posixpath.basename(output) or "libname.so")),
                      key="build.output")
        return False
    return True


def check_build_targets(backend, build):
    """B008, B010: what the manifest says of its targets, whatever the script."""
    if backend.architectures is None:
        return
    default = backend.default_arch
    if default is not None and default not in backend.architectures:
        backend.error("B008", "build.default_arch %s is not in build.architectures" % default,
                      key="build.default_arch")
    minimum = build.get("min_capability")
    if is_int(minimum):
        for index, arch in enumerate(backend.architectures):
            number = arch_number(arch)
            if number is not None and number < minimum:
                backend.error("B010", "architecture %s is below build.min_capability %d"
                              % (arch, minimum), key="build.architectures[%d]" % index)


def check_status(repo, backend):
    """T001-T002: what `validated` promises."""
    m = backend.manifest
    numerics = m.get("numerics")
    tolerance = numerics.get("tolerance") if isinstance(numerics, dict) else None
    if backend.status == "validated":
        ops = [k for k in tolerance if k != "note"] if isinstance(tolerance, dict) else []
        if not ops:
            backend.error("T001", "status is validated but numerics.tolerance gives no op "
                          "tolerance; add one per op", key="status")
    reference = m.get("reference")
    entry = reference.get("entrypoint") if isinstance(reference, dict) else None
    level = "error" if backend.status == "validated" else "warning"
    if not isinstance(entry, str) or not entry:
        if backend.status == "validated":
            backend.error("T002", "status is validated but reference.entrypoint is not given",
                          key="status")
        return
    if not inside_repository(entry):
        backend.report(level, "T002", "reference.entrypoint %s must be relative to the repository "
                       "root, and inside it" % describe(entry), key="reference.entrypoint")
    elif not os.path.isfile(os.path.join(repo.root, entry)):
        backend.report(level, "T002", "reference.entrypoint %s does not exist (it is relative to "
                       "the repository root)" % describe(entry), key="reference.entrypoint")
    elif not repo.inside(os.path.join(repo.root, entry)):
        backend.error("S002", "reference.entrypoint %s is a symbolic link to %s, outside the "
                      "repository, which parity would run; keep the reference in the repository"
                      % (describe(entry), os.path.realpath(os.path.join(repo.root, entry))),
                      key="reference.entrypoint")


def inside_repository(path):
    """Whether a repository-relative path stays inside the repository."""
    return not path.startswith("/") and ".." not in path.split("/")


def check_models(repo, backend):
    """O001: listed model directories exist (check_keys refuses the others)."""
    models = backend.manifest.get("models")
    if not isinstance(models, list):
        return
    for index, model in enumerate(models):
        if is_model_dir(model) and not os.path.isdir(os.path.join(repo.root, model)):
            backend.warning("O001", "models lists %s, which does not exist" % describe(model),
                            key="models[%d]" % index)


# (check, runs for planned backends too)
CHECKS = (
    (check_keys, True),
    (check_sources, False),  # before check_abi, which does not read what this rejects
    (check_abi, True),
    (check_build_script, False),
    (check_status, False),
    (check_models, False),
)


def check_index_modes(repo, backends):
    """B003: each build script is executable in the git index (or, tracked
    as a link, its target is).  The index is listed once for all backends."""
    if repo.git is None:
        return
    for backend in backends:
        path = backend.index_path
        if path is None:
            continue
        full = os.path.join(repo.root, path)
        mode = repo.git.mode(full)
        rel = path[len(backend.rel_dir) + 1:]
        if mode == "120000":  # a link runs its target
            real = os.path.realpath(full)
            target, target_mode = os.path.relpath(real, repo.real_root), repo.git.mode(real)
            if target_mode is not None and target_mode != "100755":
                backend.error("B003", "build script %s is tracked as a link to %s, which has mode "
                              "%s in the git index; run: git update-index --chmod=+x %s"
                              % (rel, target, target_mode, target), path)
        elif mode is not None and mode != "100755":
            backend.error("B003", "build script %s has mode %s in the git index; run: "
                          "git update-index --chmod=+x %s"
                          % (rel, mode, path), path)


def check_backend(repo, backend):
    # Only a link can lead out (the walk follows no linked directory): no realpath per backend.
    if backend.files.get(backend.name + MANIFEST_SUFFIX) == "link" and not repo.inside(
            backend.manifest_path):
        backend.error("S002", "%s is a symbolic link to %s, outside the repository; the check does "
                      "not follow it (replace the link with the file it stands for)"
                      % (backend.name + MANIFEST_SUFFIX, os.path.realpath(backend.manifest_path)))
        return
    load(backend)
    if backend.manifest is None:
        return
    for check, for_planned in CHECKS:
        if backend.status == "planned" and not for_planned:
            continue
        check(repo, backend)


# ---------------------------------------------------------------------------
# Running a check over a repository


class Run:
    """The outcome of checking the selected backends."""

    def __init__(self, root, backends, diagnostics):
        self.root = root
        self.backends = backends
        found = sorted(diagnostics, key=Diagnostic.sort_key)
        self.diagnostics = [d for d in found if d.suppressed is None]
        self.suppressed = [d for d in found if d.suppressed is not None]

    def count(self, level):
        return sum(1 for d in self.diagnostics if d.level == level)

    def errors_of(self, backend):
        return [d for d in self.diagnostics if d.backend == backend.key and d.level == "error"]


def select(backends, loose, names, repo):
    """The backends (and discovery findings) named on the command line: a
    name is `<platform>/<name>`, `<name>`, or the backend's directory
    (`backends/cpu/x/`); anything else is a usage error that suggests the
    nearest command or backend."""
    if not names:
        return backends, loose
    keys = sorted({b.key for b in backends} | {d.backend for d in loose if "/" in d.backend})
    chosen = set()
    for given in names:
        name = given.rstrip("/")
        if name.startswith(repo.backends_dir + "/"):
            name = name[len(repo.backends_dir) + 1:]
        matches = {k for k in keys if name in (k, k.split("/", 1)[-1])}
        if not matches:
            raise UsageError(unknown_name(given, name, keys, repo))
        chosen |= matches
    return ([b for b in backends if b.key in chosen],
            [d for d in loose if d.backend in chosen])


def unknown_name(given, name, keys, repo):
    """The message for a NAME that names no backend."""
    message = 'no backend named "%s" under %s/ (known: %s)' % (
        given, repo.backends_dir, ", ".join(keys) or "none")
    if name in COMMANDS:
        return message + '; "%s" is a command: give it before the options (check_contract.py %s ...)' % (
            name, name)
    if name in PLATFORMS or os.path.isdir(os.path.join(repo.backends_path, name)):
        return message + '; "%s" is a platform directory: name its backends as %s/<name>' % (name, name)
    import difflib
    command = nearest(name, list(COMMANDS))
    hint = nearest(name, keys + sorted({k.split("/", 1)[-1] for k in keys}))
    if command and not (hint and difflib.SequenceMatcher(None, name, hint).ratio() >
                        difflib.SequenceMatcher(None, name, command).ratio()):
        return message + '; did you mean the command "%s"?' % command
    return message + ('; did you mean "%s"?' % hint if hint else "")


def suppress(diagnostics, backends, ignored):
    """Mark each warning that its backend's manifest ("ignore") or the
    command line (--ignore, the codes in `ignored`) accepts, with the
    reason.  Errors are never suppressed: an error means the manifest is
    not true."""
    ignores = {b.key: b.ignore for b in backends}
    for d in diagnostics:
        if d.level != "warning":
            continue
        reason = ignores.get(d.backend, {}).get(d.code)
        if reason is None and d.code in ignored:
            reason = "--ignore %s" % d.code
        d.suppressed = reason


def unused_ignores(backends, diagnostics):
    """M006: an ignore entry for a code of the check that matches none of
    its warnings.  Entries for the codes of build, test, parity and trace are
    not judged: whether those warn depends on the machine."""
    used = {(d.backend, d.code) for d in diagnostics if d.suppressed is not None}
    errors = {(d.backend, d.code) for d in diagnostics if d.level == "error"}
    for backend in backends:
        for code in sorted(backend.ignore):
            if code[0] in CHECK_FAMILIES and (backend.key, code) not in used:
                backend.warning("M006", "ignore.%s matches no warning of %s%s; remove the entry"
                                % (code, backend.key, "; %s is an error here, which no entry can "
                                   "suppress" % code if (backend.key, code) in errors else ""),
                                key="ignore." + code)


def run_check(repo, names=(), ignored=()):
    """Check the named backends (all by default); warnings of the codes in
    `ignored`, and those each manifest's "ignore" names, are suppressed."""
    backends, loose = discover(repo)
    if not backends and not loose:
        loose.append(Diagnostic("warning", "D007", repo.backends_dir, repo.backends_dir, None,
                                "the backends directory %s holds no backend; nothing was checked "
                                "(a backend is %s/<platform>/<name>/<name>%s)"
                                % (repo.backends_dir, repo.backends_dir, MANIFEST_SUFFIX)))
    backends, loose = select(backends, loose, names, repo)
    for backend in backends:
        check_backend(repo, backend)
    check_index_modes(repo, backends)
    found = loose + [d for backend in backends for d in backend.diagnostics]
    suppress(found, backends, ignored)
    unused_ignores(backends, found)
    return Run(repo.root, backends, loose + [d for backend in backends for d in backend.diagnostics])


# ---------------------------------------------------------------------------
# Reporting


def summary_line(run):
    return "%d backend(s), %d error(s), %d warning(s)%s" % (
        len(run.backends), run.count("error"), run.count("warning"), suppressed_note(run.suppressed))


def suppressed_note(suppressed):
    """How the summary line counts the suppressed findings (nothing when none)."""
    return ", %d suppressed (--format json lists them)" % len(suppressed) if suppressed else ""


CONTROL_RE = re.compile("[\x00-\x1f\x7f-\x9f\u2028\u2029]")
CONTROL_ESCAPES = {"\n": "\\n", "\r": "\\r", "\t": "\\t"}


def escape_control(text):
    """The text with every control character (and the Unicode line and
    paragraph separators) written as a backslash escape, so that a file name
    holding a newline cannot start a report line of its own."""
    if CONTROL_RE.search(text) is None:
        return text
    return CONTROL_RE.sub(lambda m: CONTROL_ESCAPES.get(m.group()) or (
        "\\x%02x" % ord(m.group()) if ord(m.group()) < 0x100 else "\\u%04x" % ord(m.group())),
        text)


class Locator:
    """Writes a finding's place the way compilers do: a path relative to the
    current directory when the file is inside it, else relative to the
    repository root."""

    def __init__(self, root):
        try:
            self.cwd = os.path.realpath(os.getcwd())
        except OSError:  # the current directory was removed
            self.cwd = None
        self.root = os.path.realpath(root)

    def path(self, rel):
        if self.cwd is None:
            return rel
        full = os.path.normpath(os.path.join(self.root, rel))
        if full == self.cwd:
            return "."
        if full.startswith(self.cwd.rstrip("/") + "/"):
            return full[len(self.cwd.rstrip("/")) + 1:]
        return rel


def finding_line(d, locator):
    """`path:line: [level] CODE backend: message`, or `path: ...` when the
    finding has no line, or `[level] CODE backend: message` when it has no
    place; control characters escaped."""
    text = "[%s] %s %s: %s" % (d.level, d.code, d.backend, d.message)
    if d.path:
        place = locator.path(d.path)
        text = ("%s:%d: " % (place, d.line) if d.line else "%s: " % place) + text
    return escape_control(text) + "\n"


def report_text(run, out):
    locator = Locator(run.root)
    lines = [finding_line(d, locator) for d in run.diagnostics]
    lines.extend(escape_control("checked %s/%s: status=%s abi=%s" % (
        backend.platform, backend.name, backend.status or "?",
        backend.abi_version if backend.abi_version is not None else "?")) + "\n"
        for backend in run.backends)
    lines.append(summary_line(run) + "\n")
    out.write("".join(lines))


def report_json(run, out):
    json.dump({"checked": [b.key for b in run.backends],
               "issues": [d.as_dict() for d in run.diagnostics],
               "errors": run.count("error"), "warnings": run.count("warning"),
               "suppressed": [d.as_dict() for d in run.suppressed]},
              out, indent=2)
    out.write("\n")


def github_escape(text, property=False):
    text = text.replace("%", "%25").replace("\r", "%0D").replace("\n", "%0A")
    if property:
        text = text.replace(":", "%3A").replace(",", "%2C")
    return text


def annotation(d):
    """A finding as a GitHub Actions workflow command, which GitHub shows on
    the line of the file."""
    fields = []
    if d.path:
        fields.append("file=" + github_escape(d.path, True))
        if d.line:
            fields.append("line=%d" % d.line)
    fields.append("title=" + d.code)
    return "::%s %s::%s\n" % (d.level, ",".join(fields),
                              github_escape("%s: %s" % (d.backend, d.message)))


def report_github(run, out):
    out.write("".join(annotation(d) for d in run.diagnostics))
    out.write(summary_line(run) + "\n")


def report_sarif(run, out):
    """SARIF 2.1.0, what GitHub code scanning reads: every finding, the
    suppressed ones with their reason."""
    from urllib.parse import quote
    results = []
    for d in run.diagnostics + run.suppressed:
        result = {"ruleId": d.code, "level": d.level,
                  "message": {"text": "%s: %s" % (d.backend, d.message)}}
        if d.path:
            # A name that is not UTF-8 (held as surrogates) goes as its bytes, percent-encoded.
            location = {"artifactLocation": {"uri": quote(os.fsencode(d.path)), "uriBaseId": "%SRCROOT%"}}
            if d.line:
                location["region"] = {"startLine": d.line}
            result["locations"] = [{"physicalLocation": location}]
        if d.suppressed is not None:
            result["suppressions"] = [{"kind": "external", "justification": d.suppressed}]
        results.append(result)
    codes = sorted({d.code for d in run.diagnostics + run.suppressed})
    json.dump({"$schema": "https://json.schemastore.org/sarif-2.1.0.json", "version": "2.1.0",
               "runs": [{"tool": {"driver": {"name": "check_contract.py", "version": VERSION,
                                             "rules": [{"id": code} for code in codes]}},
                         "results": results}]}, out, indent=2)
    out.write("\n")


REPORTERS = {"text": report_text, "json": report_json, "github": report_github,
             "sarif": report_sarif}


# ---------------------------------------------------------------------------
# Binary inspection (pure Python: no readelf, no cuobjdump)
#
# The dynamic symbols of an ELF shared object, and the targets embedded in the
# CUDA fatbinaries it carries.  A fatbinary container starts with the magic
# 0xBA55ED50; each entry in it has a kind (1 PTX, 2 SASS), the target number
# as the u32 at entry offset 28, and flags at offset 40 (0x100000 marks an
# arch-specific target such as "90a", 0x200000 a family target such as
# "100f").  A SASS entry's payload is a cubin, an ELF file: it is a target
# only when its symbol table holds a function, since nvcc's link step adds a
# cubin for its default architecture (the device-link stub, sm_75 with CUDA
# 13) that holds no kernel.  A compressed payload (nvcc -Xfatbin
# -compress-all, zstd) cannot be read here: its target is sealed, neither
# proved nor disproved.  A library built by nvcc carries more than one
# container listing the same targets; the union is what the library runs on.

ELF_MAGIC = b"\x7fELF"
# What the linker itself defines in a shared object, whatever its sources.
LINKER_SYMBOLS = frozenset(("_init", "_fini", "_edata", "_end", "__bss_start"))
ELF_TYPE_SHARED = 3
SECTION_SYMTAB, SECTION_DYNSYM = 2, 11
SYMBOL_FUNCTION = 2
FATBIN_MAGIC = 0xBA55ED50
FATBIN_KIND_PTX = 1
FATBIN_KIND_SASS = 2
FATBIN_ARCH_SPECIFIC = 0x100000
FATBIN_FAMILY = 0x200000


class BinaryError(Exception):
    """The file is not a shared object this inspection can read."""


class SharedObject:
    """An ELF shared object: its bytes, its sections and its defined dynamic symbols."""

    def __init__(self, data, sections, dynamic_symbols):
        self.data = data
        self.sections = sections  # name -> (offset, size)
        self.dynamic_symbols = dynamic_symbols


def _unpack(fmt, data, offset, what):
    import struct
    try:
        return struct.unpack_from(fmt, data, offset)
    except struct.error:
        raise BinaryError("truncated ELF file (%s at offset %d)" % (what, offset)) from None


def read_shared_object(path):
    """The SharedObject at path; BinaryError with a one-line reason otherwise."""
    try:
        with open(path, "rb") as handle:
            data = handle.read()
    except OSError as exc:
        raise BinaryError("cannot be read: %s" % (exc.strerror or exc)) from None
    if data[:4] != ELF_MAGIC:
        raise BinaryError("not an ELF file")
    if data[4:6] != b"\x02\x01":
        raise BinaryError("not a 64-bit little-endian ELF file")
    (elf_type,) = _unpack("<H", data, 16, "header")
    if elf_type != ELF_TYPE_SHARED:
        raise BinaryError("an ELF file of type %d, not a shared object (type 3)" % elf_type)
    (section_offset,) = _unpack("<Q", data, 40, "header")
    entry_size, count, names_index = _unpack("<HHH", data, 58, "header")
    headers = []
    for index in range(count):
        name, kind, _, _, offset, size, link, _, _, entsize = _unpack(
            "<IIQQQQIIQQ", data, section_offset + index * entry_size, "section header")
        headers.append((name, kind, offset, size, link, entsize))
    sections = {}
    if names_index < len(headers):
        names = headers[names_index][2]
        for name, _, offset, size, _, _ in headers:
            end = data.find(b"\0", names + name)
            sections[data[names + name:end].decode("latin-1")] = (offset, size)
    symbols = set()
    for _, kind, offset, size, link, entsize in headers:
        if kind != SECTION_DYNSYM or not entsize or link >= len(headers):
            continue
        strings = headers[link][2]
        for base in range(offset, offset + size - entsize + 1, entsize):
            name, _, _, section = _unpack("<IBBH", data, base, "symbol")
            if section == 0 or not name:  # undefined: imported, not exported
                continue
            end = data.find(b"\0", strings + name)
            symbols.add(data[strings + name:end].decode("latin-1"))
    return SharedObject(data, sections, symbols)


def _fatbin_containers(data, start, end):
    """(offset, header size, payload size) of consecutive fatbinary containers."""
    import struct
    pos = start
    while pos + 16 <= end:
        magic, _, header_size, size = struct.unpack_from("<IHHQ", data, pos)
        if magic != FATBIN_MAGIC or header_size < 16 or pos + header_size + size > end:
            return
        yield pos, header_size, size
        pos = (pos + header_size + size + 7) & ~7


def cubin_has_code(data, start, end):
    """Whether the cubin (an ELF file) at data[start:end] defines a
    function; None when it is no ELF file this can read (compressed)."""
    import struct
    if data[start:start + 6] != ELF_MAGIC + b"\x02\x01" or end - start < 64:
        return None
    (section_offset,) = struct.unpack_from("<Q", data, start + 40)
    entry_size, count = struct.unpack_from("<HH", data, start + 58)
    for index in range(count):
        at = start + section_offset + index * entry_size
        if at + 64 > end:
            return None
        _, kind, _, _, offset, size, _, _, _, entsize = struct.unpack_from("<IIQQQQIIQQ", data, at)
        if kind != SECTION_SYMTAB or entsize < 24 or start + offset + size > end:
            continue
        for base in range(start + offset, start + offset + size - entsize + 1, entsize):
            info, _, section = struct.unpack_from("<BBH", data, base + 4)
            if info & 0xF == SYMBOL_FUNCTION and section != 0:
                return True
    return False


def cuda_targets(shared):
    """(sass, ptx, sealed): the sets of targets ("80", "90a") in the
    library's fatbinaries: machine code with kernels in it, PTX, and
    compressed machine code that cannot be read."""
    import struct
    data = shared.data
    if ".nv_fatbin" in shared.sections:
        offset, size = shared.sections[".nv_fatbin"]
        regions = [(offset, offset + size)]
    else:  # stripped of section headers: look for the containers themselves
        magic = struct.pack("<I", FATBIN_MAGIC)
        regions, pos = [], data.find(magic)
        while pos != -1:
            regions.append((pos, len(data)))
            pos = data.find(magic, pos + 4)
    sass, ptx, sealed = set(), set(), set()
    for start, end in regions:
        for base, header_size, size in _fatbin_containers(data, start, end):
            pos, stop = base + header_size, base + header_size + size
            while pos + 48 <= stop:
                kind, _, entry_size, payload = struct.unpack_from("<HHIQ", data, pos)
                (target,) = struct.unpack_from("<I", data, pos + 28)
                (flags,) = struct.unpack_from("<Q", data, pos + 40)
                if entry_size < 48:
                    break
                suffix = "a" if flags & FATBIN_ARCH_SPECIFIC else "f" if flags & FATBIN_FAMILY else ""
                if kind == FATBIN_KIND_SASS:
                    code = cubin_has_code(data, pos + entry_size, min(stop, pos + entry_size + payload))
                    if code is not False:
                        (sass if code else sealed).add("%d%s" % (target, suffix))
                elif kind == FATBIN_KIND_PTX:
                    ptx.add("%d%s" % (target, suffix))
                pos += entry_size + payload
    return sass, ptx, sealed - sass


# HIP code objects sit in clang offload bundles in the section .hip_fatbin:
# one bundle per translation unit (one for the library with -fgpu-rdc), with
# zeros between them up to the next 4096 boundary.  A bundle is the magic, a
# u64 entry count, then per entry (unaligned) a u64 offset from the bundle's
# start, a u64 size, a u64 id length and the id, as
# "hipv4-amdgcn-amd-amdhsa--gfx90a:xnack+" (older ROCm: "hip-amdgcn-amd-
# amdhsa-gfx906"), beside an empty "host-..." entry.  Newer ROCm may compress
# a bundle: "CCOB", a u16 version, a u16 method (0 zlib, 1 zstd), the sizes
# of its version (below), a u64 hash, then the compressed bundle.  Only ids
# are read: the id is what the HIP runtime matches against the GPU.
BUNDLE_MAGIC = b"__CLANG_OFFLOAD_BUNDLE__"
COMPRESSED_BUNDLE_MAGIC = b"CCOB"
# Version -> its sizes: (uncompressed), (total, uncompressed), both u64 from 3.
COMPRESSED_BUNDLE_SIZES = {1: "<I", 2: "<II", 3: "<QQ"}
COMPRESSION_ZLIB, COMPRESSION_ZSTD = 0, 1
HIP_BUNDLE_ID_RE = re.compile(r"hip(?:v4)?-amdgcn-amd-amdhsa-(?:[a-z0-9_]*-)?(gfx.+)\Z")
ZEROS_RE = re.compile(b"\0*")


def hip_targets(shared):
    """The target ids ("gfx90a", "gfx90a:xnack+") of the code objects in the
    library's offload bundles; BinaryError when one cannot be read."""
    if ".hip_fatbin" not in shared.sections:
        if not shared.sections:
            raise BinaryError("it has no section headers, so its .hip_fatbin cannot be found")
        return set()
    data = shared.data
    start, size = shared.sections[".hip_fatbin"]
    pos, end = start, start + size
    targets = set()
    while pos < end:
        if data.startswith(BUNDLE_MAGIC, pos):
            ids, pos = _bundle_ids(data, pos, end, pos)
        elif data.startswith(COMPRESSED_BUNDLE_MAGIC, pos):
            ids, pos = _compressed_bundle_ids(data, pos, end)
        else:
            raise BinaryError("no offload bundle at offset %d, in its .hip_fatbin" % pos)
        for entry in ids:
            if not entry.startswith("host-"):
                match = HIP_BUNDLE_ID_RE.match(entry)
                targets.add(match.group(1) if match else entry)
        pos = ZEROS_RE.match(data, pos, end).end()  # the padding up to the next bundle
    return targets


def _bundle_ids(data, start, end, at):
    """(ids, where the bundle ends) of the uncompressed bundle at start;
    `at` is where the library holds it, for the message."""
    (count,) = _unpack("<Q", data, start + len(BUNDLE_MAGIC), "offload bundle")
    pos, stop, ids = start + len(BUNDLE_MAGIC) + 8, start, []
    for _ in range(count):
        offset, size, length = _unpack("<QQQ", data, pos, "offload bundle entry")
        pos += 24 + length
        if pos > end or start + offset + size > end:
            raise BinaryError("a truncated offload bundle at offset %d" % at)
        ids.append(data[pos - length:pos].decode("latin-1"))
        stop = max(stop, start + offset + size)
    return ids, max(pos, stop)


def _compressed_bundle_ids(data, start, end):
    """(ids, where it ends) of the compressed bundle at start."""
    import struct
    import zlib
    version, method = _unpack("<HH", data, start + 4, "compressed offload bundle")
    if version not in COMPRESSED_BUNDLE_SIZES:
        raise BinaryError("a compressed offload bundle of version %d, which this checker cannot "
                          "read" % version)
    sizes = _unpack(COMPRESSED_BUNDLE_SIZES[version], data, start + 8, "compressed offload bundle")
    if method == COMPRESSION_ZSTD:
        raise BinaryError("its offload bundle is compressed with zstd, which Python's standard "
                          "library cannot read")
    if method != COMPRESSION_ZLIB:
        raise BinaryError("its offload bundle is compressed by method %d, which this checker "
                          "does not know" % method)
    payload = start + 8 + struct.calcsize(COMPRESSED_BUNDLE_SIZES[version]) + 8
    stop = min(end, start + sizes[0]) if len(sizes) == 2 else end
    inflater = zlib.decompressobj()
    try:
        bundle = inflater.decompress(data[payload:stop])
    except zlib.error:
        bundle = b""
    if not inflater.eof or not bundle.startswith(BUNDLE_MAGIC):
        raise BinaryError("the zlib-compressed offload bundle at offset %d does not decompress "
                          "to a bundle" % start)
    return _bundle_ids(bundle, 0, len(bundle), start)[0], stop - len(inflater.unused_data)


# Loads a library in a child process (a crashing constructor must not take the
# checker down) and prints what its version function returns.
LOAD_SNIPPET = """
import ctypes, sys
try:
    library = ctypes.CDLL(sys.argv[1])
    function = getattr(library, sys.argv[2])
except (OSError, AttributeError) as exc:
    print("LOAD-ERROR: %s" % exc)
    sys.exit(0)
function.restype = ctypes.c_uint32
function.argtypes = []
print(function())
"""


# ---------------------------------------------------------------------------
# Running backends: the build, test and parity tiers

TOOLCHAINS = {"cpu": ("CC", "cc"), "cuda": ("NVCC", "nvcc"), "hip": ("HIPCC", "hipcc")}


class TierResult:
    """What happened to one backend in a tier: passed, failed or skipped."""

    __slots__ = ("backend", "outcome", "detail", "elapsed", "diagnostics", "trace", "suppressed")

    def __init__(self, backend, outcome, detail="", elapsed=None, diagnostics=()):
        self.backend = backend
        self.outcome = outcome
        self.detail = detail
        self.elapsed = elapsed
        self.diagnostics = sorted(diagnostics, key=Diagnostic.sort_key)
        self.trace = None  # trace: what each traced run built (traced_build)
        self.suppressed = []  # the findings an ignore entry accepts (set aside by run_tier)

    def as_dict(self):
        found = {"backend": self.backend, "result": self.outcome, "detail": self.detail,
                 "elapsed": None if self.elapsed is None else round(self.elapsed, 3),
                 "issues": [d.as_dict() for d in self.diagnostics],
                 "suppressed": [d.as_dict() for d in self.suppressed]}
        if self.trace is not None:
            found["runs"] = [dict(r, elapsed=round(r["elapsed"], 3)) for r in self.trace]
        return found


class ChildOutcome:
    """How a child process ended."""

    __slots__ = ("returncode", "timed_out", "elapsed", "first_line", "error")

    def __init__(self, returncode, timed_out, elapsed, first_line, error=None):
        self.returncode = returncode
        self.timed_out = timed_out
        self.elapsed = elapsed
        self.first_line = first_line
        self.error = error


def run_streaming(command, cwd, timeout, stream, env=None, show=None):
    """Run command with its output (stdout and stderr together) copied to
    stream line by line, each line prefixed with the elapsed time (and put
    through show, when given).  At the time limit the child's whole process
    group is terminated, then killed."""
    import signal
    import subprocess
    import threading
    import time
    start = time.monotonic()
    try:
        child = subprocess.Popen(command, cwd=cwd, env=env, stdin=subprocess.DEVNULL,
                                 stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                 start_new_session=True)
    except OSError as exc:
        return ChildOutcome(None, False, 0.0, None, exc.strerror or str(exc))
    first = []

    def pump():
        for raw in iter(child.stdout.readline, b""):
            line = raw.decode("utf-8", "replace").rstrip("\r\n")
            if not first:
                first.append(line)
            # Escaped: a \r or an escape sequence must not forge a line of the report.
            shown = escape_control(show(line) if show else line)
            stream.write("[%7.1fs] %s\n" % (time.monotonic() - start, shown))
            stream.flush()

    reader = threading.Thread(target=pump, daemon=True)
    # A blocking wait, the time limit kept by a timer: Popen.wait(timeout)
    # polls, and notices the exit up to 50 ms late.
    timed_out = threading.Event()

    def expire():
        if child.poll() is None:  # not ended as the time ran out
            timed_out.set()
            _stop(child)

    timer = threading.Timer(timeout, expire) if timeout is not None else None
    try:
        reader.start()
        if timer is not None:
            timer.start()
        returncode = child.wait()
    except BaseException:
        _stop(child)
        raise
    finally:
        if timer is not None:
            timer.cancel()
            if timer.is_alive():  # started, and perhaps stopping the child
                timer.join()
    _signal_group(child, signal.SIGKILL)  # what the child left running in its group
    reader.join(5)
    child.stdout.close()
    return ChildOutcome(returncode, timed_out.is_set(), time.monotonic() - start,
                        first[0] if first else None)


def _stop(child):
    """Terminate the child's process group (a trace launcher then kills
    everything the script started), then kill it; returns its status."""
    import signal
    import subprocess
    _signal_group(child, signal.SIGTERM)
    try:
        return child.wait(5)
    except subprocess.TimeoutExpired:
        _signal_group(child, signal.SIGKILL)
        return child.wait()


def _signal_group(child, signum):
    try:
        os.killpg(child.pid, signum)
    except OSError:
        pass


def tier_stream(args):
    """Where child output goes: stdout, or stderr when stdout carries JSON."""
    return sys.stderr if args.format == "json" else sys.stdout


def build_backend(repo, run, backend, args, stream):
    """R001-R011: build one backend and inspect what it wrote."""
    import shutil
    key = backend.key
    if backend.status == "planned":
        return TierResult(key, "skipped", "status is planned")
    errors = run.errors_of(backend)
    if errors or backend.build_script is None or backend.output is None:
        diagnostic = Diagnostic("error", "R009", key, backend.rel(backend.name + MANIFEST_SUFFIX), None,
                                "not buildable: the contract check reports %d error(s); run "
                                "check_contract.py check %s" % (len(errors), key))
        return TierResult(key, "failed", diagnostic.message, diagnostics=[diagnostic])
    toolchain = TOOLCHAINS.get(backend.platform)
    if toolchain is None:
        return TierResult(key, "skipped", "no known toolchain for platform %s" % backend.platform)
    tool = os.environ.get(toolchain[0]) or toolchain[1]
    if shutil.which(tool) is None:
        return TierResult(key, "skipped", "%s not found (set %s or put %s on PATH)"
                          % (tool, toolchain[0], toolchain[1]))
    out_root = args.out if args.out is not None else os.path.join(repo.root, "build", "backends")
    out_dir = os.path.join(os.path.abspath(out_root), backend.platform, backend.name)
    command = [os.path.join(os.path.abspath(backend.dir), backend.build_script), out_dir]
    if args.arch is not None:
        command.append(args.arch)
    stream.write("==> build %s: %s\n" % (key, " ".join(command)))
    stream.flush()
    child = run_streaming(command, repo.root, args.timeout, stream)
    found = []
    script_rel = backend.rel(backend.build_script)

    def report(level, code, message, path=script_rel):
        found.append(Diagnostic(level, code, key, path, None, message))

    if child.error is not None:
        report("error", "R001", "build script %s cannot be run: %s" % (backend.build_script, child.error))
    elif child.timed_out:
        report("error", "R002", "build script %s did not finish within %gs; it was stopped"
               % (backend.build_script, args.timeout))
    elif child.returncode != 0:
        report("error", "R001", "build script %s failed with exit status %d"
               % (backend.build_script, child.returncode))
    else:
        detail = inspect_library(backend, os.path.join(out_dir, backend.output), args.arch, report)
        if not any(d.level == "error" for d in found):
            return TierResult(key, "passed", detail, child.elapsed, found)
    return TierResult(key, "failed", found[-1].message if found else "", child.elapsed, found)


def inspect_library(backend, path, arch, report):
    """Check the library the build wrote; returns a one-line summary."""
    import subprocess
    output = backend.output
    if not os.path.isfile(path):
        report("error", "R003", "the build did not write %s (build.output) into its output "
               "directory" % output)
        return ""
    try:
        shared = read_shared_object(path)
    except BinaryError as exc:
        report("error", "R004", "%s is not a usable shared object: %s" % (output, exc))
        return ""
    prefix = backend.abi_prefix
    if prefix is None:
        report("error", "R005", "cannot check the exported ABI of %s: the sources define no "
               "<PREFIX>_ABI_VERSION" % output)
        return ""
    summary = ["exports %s_abi_version and %s_error_string" % (prefix, prefix)]
    for symbol in (prefix + "_abi_version", prefix + "_error_string"):
        if symbol not in shared.dynamic_symbols:
            report("error", "R005", "%s does not export %s" % (output, symbol))
    foreign = sorted(s for s in shared.dynamic_symbols
                     if not s.startswith(prefix + "_") and s not in LINKER_SYMBOLS)
    if foreign:
        # hipcc exports a __global__ kernel's host-side handle whatever the
        # default visibility; only internal linkage keeps it in.
        how = ("put each __global__ kernel in an anonymous namespace or make it static; "
               "-fvisibility=hidden does not hide a kernel's handle under hipcc"
               if backend.platform == "hip" else "-fvisibility=hidden, and "
               "__attribute__((visibility(\"default\"))) on the ABI's functions")
        report("error", "R010", "%s exports %d name(s) without the prefix %s_ (%s%s), which the C "
               "ABI gives every name; hide them (%s)"
               % (output, len(foreign), prefix, ", ".join(foreign[:5]),
                  ", ..." if len(foreign) > 5 else "", how))
    if prefix + "_abi_version" in shared.dynamic_symbols:
        done = subprocess.run([sys.executable, "-c", LOAD_SNIPPET, path, prefix + "_abi_version"],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, check=False)
        said = done.stdout.decode("utf-8", "replace").strip()
        if done.returncode != 0 or not said.isdigit():
            reason = said[len("LOAD-ERROR: "):] if said.startswith("LOAD-ERROR: ") else (
                "the loading process ended with status %d" % done.returncode)
            report("warning", "R007", "%s cannot be loaded here: %s" % (output, reason))
        elif int(said) != backend.abi_version:
            report("error", "R006", "%s_abi_version() in %s returns %s but abi_version is %d"
                   % (prefix, output, said, backend.abi_version))
        else:
            summary.append("%s_abi_version() = %s" % (prefix, said))
    if backend.platform == "cuda":
        sass, ptx, sealed = cuda_targets(shared)
        expected = {arch} if arch is not None else set(backend.architectures or ())
        sass |= sealed & expected
        check_library_targets("the fatbinary of %s holds SASS for" % output, sass, backend, arch,
                              report)
        if sealed - expected:
            report("warning", "R011", "cannot tell whether the compressed SASS for %s in %s holds "
                   "kernels or only nvcc's device-link stub; build with nvcc -compress-mode=none to "
                   "have it read" % (", ".join(sorted(sealed - expected)), output))
        summary.append("SASS %s" % ", ".join(sorted(sass)) + (
            "; PTX %s" % ", ".join(sorted(ptx)) if ptx else ""))
    elif backend.platform == "hip":
        try:
            targets = hip_targets(shared)
        except BinaryError as exc:
            report("warning", "R011", "cannot verify the gfx targets of %s: %s" % (output, exc))
            summary.append("gfx targets not verified")
        else:
            check_library_targets("the offload bundles of %s hold code objects for" % output,
                                  targets, backend, arch, report)
            summary.append("gfx targets %s" % ", ".join(sorted(targets)))
    return "; ".join(summary)


def check_library_targets(holds, found, backend, arch, report):
    """R008: the targets found in the library against --arch, or else
    build.architectures; `holds` says where they were found."""
    expected = {arch} if arch is not None else set(backend.architectures or ())
    if found != expected:
        report("error", "R008", "%s %s but %s"
               % (holds, ", ".join(sorted(found)) or "no architecture",
                  "--arch is %s" % arch if arch is not None else
                  "build.architectures is %s" % ", ".join(sorted(expected))))


def test_backend(repo, run, backend, args, stream):
    """U001-U003: run the backend's tests beside its kernels."""
    key = backend.key
    tests = [p for p in sorted(backend.files) if p.rsplit("/", 1)[-1].startswith("test_")
             and p.endswith(".py")]
    if not tests:
        if backend.status == "planned":
            return TierResult(key, "skipped", "status is planned and there are no tests")
        warning = Diagnostic("warning", "U002", key, backend.rel_dir, None,
                             "has no tests (test_*.py) beside its kernels; add them under "
                             "%s/tests/" % backend.rel_dir)
        return TierResult(key, "skipped", "no tests", diagnostics=[warning])
    hidden = [p for p in tests if not discoverable(backend.files, p)]
    if hidden == tests:
        package = hidden[0].rsplit("/", 1)[0]
        message = ("unittest would run none of the tests (%s): %s/ has no __init__.py, and unittest "
                   "discovers tests only in packages; add %s/__init__.py"
                   % (", ".join(hidden[:3]), package, backend.rel(package)))
        failure = Diagnostic("error", "U001", key, backend.rel(hidden[0]), None, message)
        return TierResult(key, "failed", message, diagnostics=[failure])
    command = [sys.executable, "-m", "unittest", "discover", "-v", "-s", backend.rel_dir,
               "-t", backend.rel_dir]
    stream.write("==> test %s: %s\n" % (key, " ".join(command)))
    stream.flush()
    child = run_streaming(command, repo.root, args.timeout, stream)
    if child.error is None and not child.timed_out and child.returncode == 0:
        return TierResult(key, "passed", "", child.elapsed)
    if child.timed_out:
        code, message = "U003", "tests did not finish within %gs; they were stopped" % args.timeout
    else:
        code, message = "U001", "tests failed (%s)" % (
            child.error or "exit status %d" % child.returncode)
    failure = Diagnostic("error", code, key, backend.rel_dir, None, message)
    return TierResult(key, "failed", message, child.elapsed, [failure])


def discoverable(files, path):
    """Whether `unittest discover` finds a test file: each directory above
    it is a package (holds __init__.py)."""
    parts = path.split("/")[:-1]
    return all("/".join(parts[:n]) + "/__init__.py" in files for n in range(1, len(parts) + 1))


def parity_backend(repo, run, backend, args, stream):
    """P001-P002: run the backend's reference entrypoint."""
    key = backend.key
    reference = (backend.manifest or {}).get("reference")
    entry = reference.get("entrypoint") if isinstance(reference, dict) else None
    if not isinstance(entry, str) or not entry:
        return TierResult(key, "skipped", "declares no reference.entrypoint")
    rel, problem = normalize_relpath(entry)
    path = os.path.join(repo.root, rel or "")
    why = ("does not exist" if problem or not os.path.isfile(path) else None if repo.inside(path) else
           "is a symbolic link to %s, outside the repository; parity runs no file from outside it"
           % os.path.realpath(path))
    if why:
        failure = Diagnostic("error", "P001", key, backend.rel(backend.name + MANIFEST_SUFFIX), None,
                             "reference.entrypoint %s %s" % (describe(entry), why))
        return TierResult(key, "failed", failure.message, diagnostics=[failure])
    command = [sys.executable, rel]
    stream.write("==> parity %s: %s\n" % (key, " ".join(command)))
    stream.flush()
    child = run_streaming(command, repo.root, args.timeout, stream)
    if child.error is None and not child.timed_out and child.returncode == 0:
        first = child.first_line or ""
        if first.startswith("SKIP:"):
            return TierResult(key, "skipped", first[len("SKIP:"):].strip(), child.elapsed)
        return TierResult(key, "passed", "", child.elapsed)
    if child.timed_out:
        code, message = "P002", "%s did not finish within %gs; it was stopped" % (rel, args.timeout)
    else:
        code, message = "P001", "%s failed (%s)" % (rel, child.error or "exit status %d" % child.returncode)
    failure = Diagnostic("error", code, key, rel, None, message)
    return TierResult(key, "failed", message, child.elapsed, [failure])


# ---------------------------------------------------------------------------
# The trace tier: the build script run with compiler shims in place
#
# `trace` runs a build script as CI would, on a temporary copy of the
# repository (the files git lists, submodules' among them, with a .git
# cloned from the checkout's HEAD; or every file but .git outside a git work
# tree; copied once per command and again for each run from that snapshot),
# with a fresh, read-only shim in place of every compiler: first on PATH, in $NVCC,
# $HIPCC, $CC and $CXX, and in the fake toolkit that CUDA_HOME, CUDA_PATH,
# HIP_PATH and ROCM_PATH name.  A shim is a sh script that records its
# arguments, creates the files the real compiler would (the one its -o
# names, never /dev/null; the objects and depfiles named after its inputs),
# passes --version-style questions and build systems' compiler probes to the
# real compiler where the machine has one, and does nothing else: no toolchain
# is needed, and nothing of the build is compiled.  The script itself does run: what it does besides
# calling compilers (mkdir, make, cp) happens, inside the copy and the
# temporary directory.  It runs from a launcher (TRACE_LAUNCHER) with an empty
# environment; where unprivileged namespaces are allowed, in user, mount, PID
# and network namespaces, in a root of its own holding only what
# isolation_plan lists, else as the launcher's subreaped descendant.  Either way every
# process it started is killed when it ends, and the checkout, the snapshot
# and the shims are compared with what they were before it ran.  A compiler called by an absolute path
# (/usr/bin/gcc) gets past the shims; bash's xtrace, switched on in every
# bash the script starts (BASH_ENV), shows such calls.

TRACE_VERSIONED = ("gcc", "g++", "clang", "clang++")
TRACE_VERSIONS = tuple(str(n) for n in range(7, 23))  # gcc-12, clang++-18
TRACE_WRAPPERS = ("ccache", "sccache")
TRACE_COMPILER_VARIABLES = (("NVCC", "nvcc"), ("HIPCC", "hipcc"), ("CC", "cc"), ("CXX", "c++"))
TRACE_TOOLKIT_VARIABLES = ("CUDA_HOME", "CUDA_PATH", "HIP_PATH", "ROCM_PATH")
# All a traced script keeps of the caller's environment: the default
# invocation sets no optional variable.
TRACE_KEPT_VARIABLES = ("PATH", "LANG", "LC_ALL", "LC_CTYPE", "TERM", "USER", "LOGNAME")
TRACE_TIMEOUT = 120.0  # seconds a run of a script may take, unless --timeout says otherwise
TRACE_LOG_CAP = 1 << 20       # bytes a shim's record of one call may hold
TRACE_LOG_ENTRIES = 100000    # records in the call log of one run
TRACE_XTRACE_CAP = 64 << 20   # bytes of bash's trace read for compilers run by their path
# Set (to anything but empty) to isolate traced scripts by the launcher alone.
NO_NAMESPACES_VARIABLE = "CHECK_CONTRACT_NO_NAMESPACES"
UNSHARE_OPTIONS = ("--user", "--map-root-user", "--mount", "--pid", "--fork", "--net",
                   "--mount-proc", "--kill-child")
# What a traced script sees in namespaces besides its own files
# (isolation_plan): read-only, the directories programs and libraries run
# from, the files of /etc they read, the directories on PATH; its own /tmp,
# /dev (these devices) and /proc.
ISOLATION_SYSTEM = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32", "/opt")
ISOLATION_ETC = ("alternatives", "bash.bashrc", "group", "hosts", "inputrc", "ld.so.cache",
                 "ld.so.conf", "ld.so.conf.d", "localtime", "nsswitch.conf", "os-release", "passwd",
                 "python3*")
ISOLATION_DEVICES = ("null", "zero", "full", "random", "urandom", "tty")
# What a traced script reaches without namespaces.
UNISOLATED = ("the script runs as you and reaches what you can: every file you may read or write "
              "(the checkout, your home, the host's /tmp), the network, the host's sockets and "
              "the environment of your other processes, the checker's among them")

TRACE_SHIM = r"""#!/bin/sh
# Written by check_contract.py trace in place of a compiler: records its
# arguments, creates the files the real compiler would (a shared object nm
# and strip read, an executable that does nothing, an empty object file,
# a depfile with one rule) and answers version probes.  What a script asks
# a compiler of itself, and a build system's probe of it, it hands to the
# real compiler where the machine has one; it compiles nothing of the build.
name=${0##*/} via= word=${0##*/}
case $name in
ccache|sccache)
    case ${1:--} in -*) exit 0 ;; esac  # a statistics or configuration call
    via=$name word=$1 name=${1##*/}
    shift ;;
esac
real_compiler() {  # the first $name on PATH that is no shim and runs none (as ccache would)
    (set -f
    IFS=:
    for dir in $PATH; do
        [ "$dir" != %(bin)s ] && [ -f "$dir/$name" ] && [ -x "$dir/$name" ] || continue
        case $(readlink -f "$dir/$name") in */ccache|*/sccache) continue ;; esac
        echo "$dir/$name"
        exit 0
    done
    exit 1)
}
# A call made by the real compiler of a build system's probe (nvcc running
# its host compiler) is the probe's, not the script's: the real one runs it.
if [ -n "${CHECK_CONTRACT_PROBE-}" ] && real=$(real_compiler); then exec "$real" "$@"; fi
record=%(log)s/"$(date +%%s%%N).$$"
before= after=  # the words of the variables the compiler reads around its arguments
case $name in
%(variables)s
esac
printf '%%s\0' "$via" "$PWD" "$before" "$after" "$#" "$word" "$@" > "$record"
options() {  # the text of each options file (nvcc -optf, @file) of the arguments, in order
    next=
    for arg in "$@"; do
        files=
        case $name,$next,$arg in
        nvcc*,optf,*) files=$arg ;;
        nvcc*,,-optf|nvcc*,,--options-file) next=optf; continue ;;
        nvcc*,,-optf=*|nvcc*,,--options-file=*) files=${arg#*=} ;;
        nvcc*) ;;
        *,,@?*) files=${arg#@} ;;
        esac
        next=
        case $name in nvcc*) IFS=, ;; *) IFS= ;; esac  # nvcc takes a list
        for file in $files; do
            if [ -f "$file" ] && [ -r "$file" ]; then printf '%%s\0' "$(cat "$file")" >> "$record"
            else
                case $name in nvcc*)
                    echo "nvcc fatal   : Could not open options file '$file'" >&2; exit 1 ;;
                esac
                printf '\1\0' >> "$record"  # gcc and clang take the word as it is
            fi
        done
        unset IFS
    done
}
set -f
options $before "$@" $after
set +f
out= next= probe= place= stdin= made=program suffix=.o dep= depfile=
for arg in "$@"; do
    case $next in
    o) out=$arg next=; continue ;;
    MF) depfile=$arg next=; continue ;;
    skip) next=; continue ;;
    esac
    case $arg in
    -shared|--shared) [ "$made" = object ] || made=library ;;
    -c|--compile|-dc|--device-c|--genco|--cuda-device-only) made=object ;;
    -S) made=object suffix=.s ;;
    -E) made=object suffix= ;;
    -M|-MM) made=object suffix= dep=main ;;
    -ptx|--ptx) made=object suffix=.ptx ;;
    -cubin|--cubin) made=object suffix=.cubin ;;
    -fatbin|--fatbin) made=object suffix=.fatbin ;;
    -MD|-MMD|--generate-dependencies-with-compile|--generate-nonsystem-dependencies-with-compile)
        dep=side ;;
    -MF|--dependency-output) next=MF ;;
    -MF*) depfile=${arg#-MF} ;;
    -MT|-MQ|-include|-imacros|-x) next=skip ;;
    -o|--output-file) next=o ;;
    --output-file=*) out=${arg#*=} ;;
    -o=*) case $name in nvcc*) out=${arg#-o=} ;; *) out=${arg#-o} ;; esac ;;
    -o*) case $name in nvcc*) ;; *) out=${arg#-o} ;; esac ;;  # nvcc: -odir, -optf
    -) stdin=1 ;;
    --version|-dumpversion|-dumpfullversion|-dumpmachine|--list-gpu-arch|--list-gpu-code|-print-*|--print-*)
        probe=$arg ;;
    -v) [ $# -gt 1 ] || probe=$arg ;;
    conftest|conftest.*|*/conftest|*/conftest.*|*/meson-private/*|__cmake_determine_cuda) place=probe ;;
    esac
done
case $PWD/ in
*/CMakeFiles/CMakeScratch/*|*/CMakeFiles/CMakeTmp/*|*/CMakeFiles/[0-9]*/CompilerId*|*/meson-private/*)
    place=probe ;;
esac
# A question to a compiler (its version, its target, its paths) is answered by
# the real one where the machine has it, which compiles nothing; so is a
# build system's probe of it (CMake's compiler identification and
# try_compile, configure's conftest, Meson's sanity check), which builds
# only its own test program: the build system learns the machine's compiler,
# by the names the shims go by (CMake links CUDA with the g++ on nvcc's PATH).
# Not hipcc (a driver that runs the toolkit's programs, which the shims'
# toolkit does not hold), nor nvcc's questions (the session asked it once).
if [ -n "$probe$place" ]; then
    case $name,$place in hipcc*|nvcc*,) ;; *)
        if real=$(real_compiler); then
            [ -z "$place" ] || export CHECK_CONTRACT_PROBE=1
            exec "$real" "$@"
        fi ;;
    esac
fi
[ -z "$stdin" ] || cat > /dev/null  # a source read from stdin: take it, as a compiler would
case $probe in
--version)
    case $name in
    nvcc*) printf '%%s\n' %(nvcc_version)s ;;
    hipcc*) printf 'HIP version: 6.2.41133 (trace shim)\nAMD clang version 18.0.0\nTarget: x86_64-unknown-linux-gnu\n' ;;
    *clang*) printf 'clang version 18.1.8 (trace shim)\nTarget: x86_64-unknown-linux-gnu\n' ;;
    *) printf '%%s (trace shim) 12.2.0\n' "$name" ;;
    esac ;;
-dumpversion) echo 12 ;;
-dumpfullversion) echo 12.2.0 ;;
-dumpmachine) echo x86_64-linux-gnu ;;
--list-gpu-arch) printf 'compute_%%s\n' %(nvcc_numbers)s ;;
--list-gpu-code) printf 'sm_%%s\n' %(nvcc_numbers)s ;;
esac
[ -n "$probe" ] && exit 0
make_file() {  # the file $1, of the kind $made
    case $made in
    library) cat %(library)s > "$1" && chmod +x "$1" ;;
    program) printf '#!/bin/sh\nexit 0\n' > "$1" && chmod +x "$1" ;;
    *) : > "$1" ;;
    esac
}
depend() {  # the depfile $1: the rule for $2 made from $3
    printf '%%s: %%s\n' "$2" "$3" > "$1"
}
# What the real compiler names after its inputs where -o does not name it:
# the object (.o, .s, .ptx, .cubin, .fatbin) of each input compiled, a.out
# for a link, and the depfile of -MD or -MMD (-MF's, else the output's name
# with .d for its suffix, else the input's, as gcc and nvcc name it).
link=
case $out in
/dev/null|-) out= suffix= dep= ;;
'') [ "$made" = object ] || link=a.out ;;
esac
inputs=0 next=
for arg in "$@"; do
    case $next in
    skip) next=; continue ;;
    esac
    case $arg in
    -o|--output-file|-MF|--dependency-output|-MT|-MQ|-include|-imacros|-x) next=skip; continue ;;
    -*) continue ;;
    %(inputs)s) ;;
    *) continue ;;
    esac
    inputs=$((inputs + 1))
    stem=${arg##*/} && stem=${stem%%.*}
    if [ -z "$out" ] && [ "$made" = object ] && [ -n "$suffix" ]; then make_file "$stem$suffix" || exit 1; fi
    [ -n "$dep" ] || continue
    target=${out:-$stem${suffix:-.o}}
    if [ -n "$depfile" ]; then depend "$depfile" "$target" "$arg" || exit 1
    elif [ "$dep" = main ]; then continue
    elif [ -n "$out" ]; then
        base=${out##*/}
        case $base in *.*) depend "${out%%.*}.d" "$target" "$arg" ;; *) depend "$out.d" "$target" "$arg" ;; esac || exit 1
    elif [ "$made" = object ]; then depend "$stem.d" "$target" "$arg" || exit 1
    else depend "a-$stem.d" "$stem.o" "$arg" || exit 1
    fi
done
if [ -n "$out" ]; then make_file "$out" || exit 1
elif [ -n "$link" ] && [ "$inputs" -gt 0 ]; then make_file a.out || exit 1
fi
exit 0
"""

# Sourced by every bash the traced script starts: its xtrace goes to a file
# of its own, where the calls the shims did not see are looked for.
TRACE_BASH_ENV = """exec {check_contract_xtrace}>>%(xtrace)s
BASH_XTRACEFD=$check_contract_xtrace
PS4='+ '
set -x
"""

# Started as `python -I -S -c TRACE_LAUNCHER <config>` with an empty
# environment; it runs the traced script with the environment the config
# gives.  In namespaces it is pid 1 of its own PID namespace: it builds the
# script's root from an empty tmpfs by the config's "plan" (isolation_plan),
# pivots into it and detaches the host's, and enters one more user
# namespace, which locks those mounts (the script, root there, cannot undo
# them).  Without, it becomes the subreaper of all the script starts.  When
# the script ends, or on SIGTERM, it kills every process left below it.  Why
# the isolation cannot be set up ("isolation") or the script cannot be
# started ("start") goes to the config's "status" file, which it opens first
# and the script never sees.  The config comes marshalled (the launcher is
# this interpreter) and the signal module is _signal: importing json and
# signal (re, enum) would add a third to the launcher's start-up, which
# every run of a script pays.
TRACE_LAUNCHER = r"""
import _signal as signal, ctypes, marshal, os, sys
config = marshal.loads(bytes.fromhex(sys.argv[1]))
status_fd = os.open(config["status"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
libc = ctypes.CDLL(None, use_errno=True)
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_REMOUNT, MS_BIND, MS_REC, MS_PRIVATE = 1, 2, 4, 32, 4096, 16384, 1 << 18
CLONE_NEWNS, CLONE_NEWUSER, PR_SET_CHILD_SUBREAPER, MNT_DETACH = 0x20000, 0x10000000, 36, 2
# A user namespace may not drop a mount's nosuid, nodev, noexec or atime
# flags: a read-only remount repeats them (statvfs's bit, mount's bit); a
# mount with neither relatime nor noatime is strictatime.
KEPT_FLAGS = ((2, 2), (4, 4), (8, 8), (1024, 1024), (2048, 2048), (4096, 1 << 21))
ST_ATIME, MS_STRICTATIME = 1024 | 4096, 1 << 24
PIVOT_ROOT = {"x86_64": 155, "aarch64": 41, "riscv64": 41, "ppc64le": 203, "ppc64": 203,
              "s390x": 217}


def fail(what):
    os.write(status_fd, ("isolation\n%s" % what).encode())
    os._exit(125)


def call(result, what):
    if result != 0:
        fail("%s: %s" % (what, os.strerror(ctypes.get_errno())))


def mount(source, target, fstype, flags, data=None):
    inside = target.startswith(config["root"] + "/")
    call(libc.mount(source.encode(), target.encode(), fstype and fstype.encode(), flags,
                    data and data.encode()), "mount " + (target[len(config["root"]):] if inside
                                                         else target))


def read_only(target, below=True):  # target, and with below every mount under it
    with open("/proc/self/mountinfo", "rb") as handle:
        points = [os.fsdecode(line.split()[4].replace(b"\\040", b" ").replace(b"\\011", b"\t")
                              .replace(b"\\012", b"\n").replace(b"\\134", b"\\")) for line in handle]
    for point in points:
        if point == target or below and point.startswith(target + "/"):
            flags, kept = MS_REMOUNT | MS_BIND | MS_RDONLY, os.statvfs(point).f_flag
            for bit, flag in KEPT_FLAGS:
                flags |= flag if kept & bit else 0
            flags |= 0 if kept & ST_ATIME else MS_STRICTATIME
            mount("none", point, None, flags)


def build_root(root, plan):
    mount("none", "/", None, MS_REC | MS_PRIVATE)
    mount("tmpfs", root, "tmpfs", MS_NOSUID | MS_NODEV, "mode=0755")
    later = [root]  # made read-only when all below them is in place
    for step, path, link in plan:
        target = root + path
        os.makedirs(os.path.dirname(target), exist_ok=True)
        if step == "symlink":
            os.symlink(link, target)
            continue
        if step in ("bind", "ro-bind") and not os.path.isdir(path):
            os.close(os.open(target, os.O_WRONLY | os.O_CREAT, 0o644))
        else:
            os.makedirs(target, exist_ok=True)
        if step in ("tmpfs", "empty"):
            mount("tmpfs", target, "tmpfs", MS_NOSUID | MS_NODEV,
                  "mode=1777" if step == "tmpfs" else "mode=0755")
            later += [target] if step == "empty" else []
        else:
            mount(path, target, None, MS_BIND | MS_REC)
            if step == "ro-bind":
                read_only(target)
    for target in later:
        read_only(target, below=False)
    os.chdir(root)
    number = PIVOT_ROOT.get(os.uname().machine)
    if number is None:
        fail("pivot_root: no system call number known for %s" % os.uname().machine)
    call(libc.syscall(number, b".", b"."), "pivot_root")
    call(libc.umount2(b".", MNT_DETACH), "umount the host's root")
    os.chdir("/")


def descendants():
    children = {}
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open("/proc/%s/stat" % entry, "rb") as handle:
                parent = int(handle.read().rsplit(b")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        children.setdefault(parent, []).append(int(entry))
    found, todo = [], [os.getpid()]
    while todo:
        below = children.get(todo.pop(), [])
        found += below
        todo += below
    return found


def kill_all():
    while True:
        for pid in descendants():
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        try:
            os.waitpid(-1, 0)
        except ChildProcessError:
            return


def stop(signum, frame):
    kill_all()
    os._exit(128 + signum)


if config["namespaces"]:
    uid, gid = os.getuid(), os.getgid()
    try:
        build_root(config["root"], config["plan"])
    except OSError as exc:
        fail("%s: %s" % (exc.filename, exc.strerror))
    call(libc.unshare(CLONE_NEWUSER | CLONE_NEWNS), "unshare")
    for name, text in (("setgroups", "deny"), ("uid_map", "0 %d 1" % uid), ("gid_map", "0 %d 1" % gid)):
        fd = os.open("/proc/self/" + name, os.O_WRONLY)
        os.write(fd, text.encode())
        os.close(fd)
else:
    call(libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0), "prctl")
for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
    signal.signal(signum, stop)
failed, started = os.pipe()
pid = os.fork()
if pid == 0:
    os.close(failed)
    for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(signum, signal.SIG_DFL)
    try:
        os.chdir(config["cwd"])
        os.execve(config["command"][0], config["command"], config["env"])
    except OSError as exc:
        os.write(started, (exc.strerror or str(exc)).encode())
    os._exit(127)
os.close(started)
reason = os.read(failed, 4096)
if reason:
    os.write(status_fd, b"start\n" + reason)
status = 0
while True:
    try:
        done, status = os.waitpid(-1, 0)
    except ChildProcessError:
        break
    if done == pid:
        break
kill_all()
os._exit(os.WEXITSTATUS(status) if os.WIFEXITED(status) else 128 + os.WTERMSIG(status))
"""


class RecordedCall:
    """One compiler call a traced script made: its words (the compiler word
    as the script gave it first), its working directory, the wrapper
    (ccache, sccache) it went through, if any, the values of the flag
    variables its COMPILERS row names, and the text of each options file
    it read, in order."""

    __slots__ = ("words", "cwd", "via", "environment", "options")

    def __init__(self, words, cwd, via, environment=None, options=()):
        self.words = words
        self.cwd = cwd
        self.via = via
        self.environment = environment or {}
        self.options = list(options)

    def facts(self):
        """Its CompilerCall (None for no compiler call), each options file
        read from what the shim recorded of it."""
        texts = list(self.options)
        return compiler_call(self.words, cwd=self.cwd, environment=self.environment,
                             options_file=lambda path: texts.pop(0) if texts else None)


class Trace:
    """What one run of a build script under the shims did.  Paths inside the
    temporary directory are shown as what they stand for: <output-dir>, the
    repository (relative), <toolkit>, ~ (the run's HOME), $TMPDIR and <tmp>."""

    def __init__(self, command, child, calls, uncaught, written, binaries, out_dir, places):
        self.command = command    # as run, shown
        self.child = child        # its ChildOutcome
        self.calls = calls        # [RecordedCall] in the order they were made
        self.uncaught = uncaught  # compiler words run by a path outside the shims
        self.written = written    # {path under <output-dir>: size} after the run
        self.binaries = binaries  # the ELF files among them, which no shim writes
        self.out_dir = out_dir    # the temporary <output-dir>
        self.places = places      # (temporary path, shown as), longest first
        self.tampered = []        # what the script changed of the trace's own files
        self.changed = []         # checkout paths the run changed
        self.commands = []        # the command lines of bash's trace
        self.search = []          # the directories on the script's PATH it could see
        self.dangling = {}        # {path under <output-dir>: its link's text, shown} of links that dangle

    def show(self, text):
        return show_places(self.places, text)


def show_places(places, text):
    """text with each temporary path of places written as what it stands
    for, wherever it is followed by / or by no other character of a name
    (-arch=<output-dir>, -I<output-dir>/inc)."""
    for path, name in places:
        if text == path:
            return name
        text = text.replace(path + "/", name + "/" if name != "." else "")
        text = re.sub(re.escape(path) + r"(?![\w.+~-])", lambda match: name, text)
    return text


def shell_quote(word):
    return "'" + word.replace("'", "'\\''") + "'"


class Shims:
    """The compiler shims of one run, in a toolkit directory of their own:
    bin/ holds a shim for every compiler name (those on PATH among them, so
    that no installed compiler is reached by its name), bash_env what every
    bash the script starts sources.  The toolkit is read-only to the script
    (and in namespaces mounted so); its state is kept to show a change."""

    def __init__(self, toolkit, log, xtrace, nvcc, exports=()):
        self.toolkit = toolkit
        self.exports = exports  # the functions the library a shim writes defines
        self.bash_env = os.path.join(toolkit, "bash_env")
        bin_dir = os.path.join(toolkit, "bin")
        os.makedirs(bin_dir)
        shim = os.path.join(bin_dir, ".shim")
        with open(shim, "w", encoding="utf-8") as handle:
            handle.write(TRACE_SHIM % {
                "log": shell_quote(log), "nvcc_version": shell_quote(nvcc.version),
                "variables": "\n".join("%s*) %s ;;" % (name, " ".join(
                    "%s=${%s-}" % (side, variable) for side, variable in (
                        ("before", row.prepend), ("after", row.append)) if variable))
                    for name, row in COMPILERS.items() if row.prepend or row.append),
                "nvcc_numbers": " ".join(nvcc.numbers), "bin": shell_quote(bin_dir),
                "library": shell_quote(os.path.join(toolkit, "lib", "shim.so")),
                "inputs": "|".join("*" + s for s in COMPILED_SUFFIXES + (".o", ".a"))})
        # Hard links, not symbolic ones: a link costs a directory entry, not an inode.
        for name in sorted(shim_names()):
            os.link(shim, os.path.join(bin_dir, name))
        os.mkdir(os.path.join(self.toolkit, "lib"))  # ROCm's clang: llvm/bin and lib/llvm/bin
        with open(os.path.join(self.toolkit, "lib", "shim.so"), "wb") as handle:
            handle.write(shim_library(exports))
        os.symlink(".", os.path.join(self.toolkit, "llvm"))
        os.symlink("..", os.path.join(self.toolkit, "lib", "llvm"))
        toolkit_headers(os.path.join(self.toolkit, "include"))
        with open(self.bash_env, "w", encoding="utf-8") as handle:
            handle.write(TRACE_BASH_ENV % {"xtrace": shell_quote(xtrace)})
        self._chmod(0o444, 0o555)
        self.state = self._state()

    def _chmod(self, file_mode, dir_mode):
        shim = os.path.join(self.toolkit, "bin", ".shim")
        for top, dirs, files in os.walk(self.toolkit):
            for name in dirs + files:
                path = os.path.join(top, name)
                if os.path.islink(path) or path != shim and os.path.lexists(shim) and \
                        os.path.samefile(path, shim):
                    continue  # a compiler name is .shim itself: .shim's mode is its mode
                os.chmod(path, dir_mode if name in dirs or path == shim else file_mode)
        os.chmod(self.toolkit, dir_mode)

    def _state(self):
        """The toolkit's tree_state, each name still linked to bin/.shim
        recorded as such: a write through one of them changes .shim."""
        state = tree_state(self.toolkit)
        shim = state.get(os.path.join("bin", ".shim"))
        return {path: ("a link to bin/.shim",) if shim and fingerprint == shim and
                path != os.path.join("bin", ".shim") else fingerprint
                for path, fingerprint in state.items()}

    def changes(self):
        """What the script changed in the toolkit, as <toolkit>/<path>."""
        return ["<toolkit>/" + p for p in state_changes(self.state, self._state())]

    def close(self):
        import shutil
        try:
            self._chmod(0o644, 0o755)
        except OSError:
            pass  # what the script left in their place goes too
        shutil.rmtree(self.toolkit, ignore_errors=True)


# Where the machine's CUDA and HIP headers may be, after the caller's own variables.
CUDA_HEADER_HOMES = ("CUDA_HOME", "CUDA_PATH", "/usr/local/cuda", "/opt/cuda")
HIP_HEADER_HOMES = ("ROCM_PATH", "HIP_PATH", "/opt/rocm", "/usr")
# Stand-ins where the machine has none: what toolkit checks test for (a file
# there, a version macro in it), for a release as recent as MachineNvcc.RECENT.
STUB_HEADERS = {
    "cuda.h": "#define CUDA_VERSION 12080\n",
    "cuda_runtime_api.h": "#define CUDART_VERSION 12080\n",
    "cuda_runtime.h": '#include "cuda.h"\n#include "cuda_runtime_api.h"\n',
    "hip/hip_runtime.h": "#define HIP_VERSION_MAJOR 6\n"}


def toolkit_headers(include):
    """The toolkit's include/ for a script that checks for a toolkit by its
    headers ($CUDA_HOME/include/cuda_runtime.h): links to the machine's CUDA
    headers (each entry) and HIP headers (hip/), stand-ins where it has none.
    The shims compile nothing, so no header is read but by such a check."""
    os.mkdir(include)
    homes = [os.environ.get(h, "") if h.isupper() else h for h in CUDA_HEADER_HOMES]
    cuda = next((os.path.join(h, "include") for h in homes if h and os.path.isfile(
        os.path.join(h, "include", "cuda_runtime.h"))), None)
    for entry in sorted(os.listdir(cuda)) if cuda else ():
        os.symlink(os.path.join(cuda, entry), os.path.join(include, entry))
    homes = [os.environ.get(h, "") if h.isupper() else h for h in HIP_HEADER_HOMES]
    hip = next((os.path.join(h, "include", "hip") for h in homes if h and os.path.isfile(
        os.path.join(h, "include", "hip", "hip_runtime.h"))), None)
    if hip:
        os.symlink(hip, os.path.join(include, "hip"))
    for name, text in STUB_HEADERS.items():
        path = os.path.join(include, name)
        if not os.path.lexists(path):
            os.makedirs(os.path.dirname(path), exist_ok=True)
            with open(path, "w", encoding="utf-8") as handle:
                handle.write("/* A stand-in written by check_contract.py trace. */\n" + text)


def shim_names():
    """The compiler names to shim: the known ones, their usual versioned
    forms, and every compiler name a directory on PATH holds (linkers apart:
    a compiler the shims cannot intercept runs the real one)."""
    names = set(tuple(COMPILERS) + TRACE_WRAPPERS)
    names.update(n + "-" + v for n in TRACE_VERSIONED for v in TRACE_VERSIONS)
    for directory in os.environ.get("PATH", os.defpath).split(os.pathsep):
        try:
            entries = os.listdir(directory or ".")
        except OSError:
            continue
        for entry in entries:
            match = COMPILER_NAME_RE.match(entry)
            if match and match.group(1) not in LINKERS:
                names.add(entry)
    return names


def tree_state(root):
    """{path relative to root: its lstat fingerprint} for everything under
    root, links not followed.  The inode change time is in it: no write,
    chmod or rename leaves it as it was, even with the times put back.  So is
    the link count, which a link made or removed elsewhere changes, and with
    it the change time (see checkout_changes)."""
    state = {}
    start = len(os.path.join(root, ""))  # os.walk's paths are root's joined with the rest
    for top, dirs, files in os.walk(root):
        for name in dirs + files:
            path = os.path.join(top, name)
            try:
                info = os.lstat(path)
            except OSError:
                continue
            # A directory changes when its entries do; those are listed themselves.
            state[path[start:]] = (info.st_mode,) if stat.S_ISDIR(info.st_mode) else (
                info.st_mode, info.st_size, info.st_mtime_ns, info.st_ino, info.st_nlink,
                info.st_ctime_ns)
    return state


def remove_tree(path):
    """Remove path and everything below it, as a build script left it: each
    directory it took its owner's permissions from gets them back first.
    Nothing is followed through a link: one standing at path goes itself."""
    import shutil

    def unlock(entry):
        """Whether entry is a directory (by lstat), now open to its owner."""
        try:
            if not stat.S_ISDIR(os.lstat(entry).st_mode):
                return False
        except OSError:
            return False
        try:
            os.chmod(entry, stat.S_IRWXU)
        except OSError:
            pass
        return True
    if not unlock(path):
        try:
            os.unlink(path)
        except OSError:
            pass
        return
    for top, dirs, _ in os.walk(path):  # each directory is unlocked before it is listed
        for name in dirs:
            unlock(os.path.join(top, name))
    shutil.rmtree(path, ignore_errors=True)


def copy_state(copy):
    """What a run's copy of the snapshot is: the directory itself and its
    tree_state.  A run that leaves both as they were when the copy was made
    left every file as it was, so the next run may have the same copy."""
    try:
        info = os.lstat(copy)
    except OSError:
        return None
    return info.st_mode, info.st_ino, tree_state(copy)


def state_changes(before, after):
    """The paths added, removed or changed between two tree_states."""
    return sorted(p for p in set(before) | set(after) if before.get(p) != after.get(p))


def checkout_changes(before, after):
    """state_changes, less the files whose only change is their link count
    and the change time that goes with it.  A link to a file of the checkout
    made or removed outside it does that: `git clone` of a local path links
    the objects of .git, and every clone made or removed beside it changes
    them all."""
    def same_file(old, new):
        return len(old) == len(new) == 6 and old[:4] == new[:4] and old[4] != new[4]
    return [p for p in state_changes(before, after)
            if not (p in before and p in after and same_file(before[p], after[p]))]


def namespace_problem(top):
    """None when traced scripts can run in namespaces here, else why not:
    a script that does nothing is run so, in directories of its own in top."""
    import shutil
    import subprocess
    if os.environ.get(NO_NAMESPACES_VARIABLE):
        return "%s is set" % NO_NAMESPACES_VARIABLE
    unshare = shutil.which("unshare")
    if unshare is None:
        return "unshare is not installed"
    probe = os.path.join(top, "probe")
    root, toolkit, writable = (os.path.join(probe, n) for n in ("root", "toolkit", "writable"))
    for path in (probe, root, toolkit, writable):
        os.mkdir(path)
    config = {"namespaces": True, "root": root, "plan": isolation_plan(toolkit, [writable], []),
              "cwd": writable, "command": ["/bin/sh", "-c", "exit 0"], "env": {},
              "status": os.path.join(probe, "status")}
    try:
        done = subprocess.run(launcher_command(unshare, config), env={}, stdin=subprocess.DEVNULL,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=60,
                              check=False)
        status, _ = read_bounded(config["status"], READ_CHUNK)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return "unshare cannot be run (%s)" % (getattr(exc, "strerror", None) or exc)
    finally:
        remove_tree(probe)
    if done.returncode != 0:
        said = (status or b"").partition(b"\n")[2].decode("utf-8", "replace").strip() or \
            (done.stdout.decode("utf-8", "replace").strip().splitlines() or [""])[-1] or \
            "exit status %d" % done.returncode
        return "unshare %s fails (%s)" % (" ".join(UNSHARE_OPTIONS), show_places(
            [(toolkit, "<toolkit>"), (writable, "<output-dir>"), (probe, "<output-dir>/..")], said))
    return None


class MachineNvcc:
    """The machine's nvcc, as the shims' nvcc answers for it: its --version
    text and the architecture numbers --list-gpu-code lists ("75", "120")
    where there is one (a script checking the CUDA release sees the one its
    compile job has), else those of a recent release; `release` is the
    machine's ("13.0"), None when it has no nvcc that answers."""

    RECENT = ("nvcc: NVIDIA (R) Cuda compiler driver\n"
              "Cuda compilation tools, release 12.8, V12.8.93",
              ("75", "80", "86", "87", "89", "90", "100", "120"))
    RELEASE_RE = re.compile(r"release ([0-9]+\.[0-9]+)")

    def __init__(self):
        import shutil
        self.version, self.numbers = self.RECENT
        self.release = None
        nvcc = shutil.which("nvcc")
        said = [self.ask(nvcc, option) for option in ("--version", "--list-gpu-code")] if nvcc else []
        release = self.RELEASE_RE.search(said[0] or "") if said else None
        codes = re.findall(r"^sm_([0-9]+)$", said[1] or "", re.M) if said else []
        if release and codes:
            self.version, self.numbers, self.release = said[0], tuple(codes), release.group(1)

    @staticmethod
    def ask(nvcc, option):
        import subprocess
        try:
            done = subprocess.run([nvcc, option], stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                  stderr=subprocess.DEVNULL, timeout=30, check=False)
        except (OSError, subprocess.TimeoutExpired):
            return None
        return done.stdout.decode("utf-8", "replace").strip() if done.returncode == 0 else None

    def refusals(self, call):
        """Why the machine's nvcc refuses the targets of an nvcc call, as
        nvcc 13 refuses sm_70 ("Unsupported gpu architecture")."""
        if self.release is None or compiler_row(call.compiler) is not COMPILERS["nvcc"]:
            return []
        found = {}
        for kind, targets in (("sm", call.sass), ("compute", call.ptx)):
            for target in targets:
                number = DIGITS_RE.match(target).group()
                if number not in self.numbers:
                    found.setdefault(number, "%s_%s" % (kind, target))
        return ["%s, which the machine's nvcc (release %s) does not support (nvcc --list-gpu-code "
                "lists sm_%s to sm_%s); list only targets it builds" % (
                    name, self.release, min(self.numbers, key=int), max(self.numbers, key=int))
                for name in found.values()]


def isolation_plan(toolkit, writable, hidden):
    """What a traced script sees in namespaces, as the steps that build its
    root from an empty one (bubblewrap's way: nothing is there that no step
    adds), in order: [(step, path, link)].  "ro-bind" binds a host path at
    the same path read-only, "bind" writable; "symlink" makes a link;
    "tmpfs" is a writable directory of the script's own, "empty" a
    read-only empty one hiding what hidden names where a bound directory
    holds it; "proc" binds the /proc of the script's PID namespace.
    TRACE_LAUNCHER performs the steps, isolation_words() says them."""
    def inside(path, directory):
        return path == directory or path.startswith(directory.rstrip("/") + "/")
    plan = []
    for path in ISOLATION_SYSTEM:
        if os.path.islink(path):
            plan.append(("symlink", path, os.readlink(path)))
        elif os.path.isdir(path):
            plan.append(("ro-bind", path, None))
    try:
        etc = sorted(os.listdir("/etc"))
    except OSError:
        etc = []
    plan += [("ro-bind", "/etc/" + name, None) for pattern in ISOLATION_ETC
             for name in fnmatch.filter(etc, pattern)]
    for directory in os.environ.get("PATH", os.defpath).split(os.pathsep):
        if os.path.isabs(directory) and os.path.realpath(directory) == directory != "/" \
                and os.path.isdir(directory) \
                and not any(inside(directory, p) for _, p, _ in plan) \
                and not any(inside(directory, h) or inside(h, directory) for h in hidden):
            plan.append(("ro-bind", directory, None))
    plan += [("empty", h, None) for h in hidden if os.path.isdir(h) and
             any(step == "ro-bind" and inside(h, p) for step, p, _ in plan)]
    plan += [("tmpfs", "/tmp", None), ("empty", "/dev", None)]
    plan += [("bind", "/dev/" + d, None) for d in ISOLATION_DEVICES if os.path.exists("/dev/" + d)]
    plan += [("symlink", "/dev/" + name, "/proc/self/fd" + fd) for name, fd in (
        ("fd", ""), ("stdin", "/0"), ("stdout", "/1"), ("stderr", "/2"))]
    plan += [("tmpfs", "/dev/shm", None), ("proc", "/proc", None), ("ro-bind", toolkit, None)]
    return plan + [("bind", path, None) for path in writable]


def isolation_words(plan, names):
    """What a script isolated by plan sees, in words: each path as names
    calls it, else as itself."""
    def listed(*steps):
        return [names.get(p, p) for step, p, _ in plan if step in steps and p != "/dev"
                and not p.startswith("/dev/")]
    devices = [p[len("/dev/"):] for step, p, _ in plan if step == "bind" and p.startswith("/dev/")]
    return ("the script sees, read-only, %s; writable, %s; its own /tmp, /dev (%s, shm) and /proc "
            "(its own processes); nothing else (not the checkout, your home, /run or the host's "
            "/tmp), no network and, of your environment, only %s" % (
                ", ".join(listed("ro-bind", "symlink")), " and ".join(listed("bind")),
                ", ".join(devices), kept_variables()))


def kept_variables():
    return ", ".join(TRACE_KEPT_VARIABLES[:-1]) + " and " + TRACE_KEPT_VARIABLES[-1]


def launcher_command(unshare, config):
    """The command that runs config's script from TRACE_LAUNCHER, in
    namespaces when unshare is given."""
    import marshal
    command = [sys.executable, "-I", "-S", "-c", TRACE_LAUNCHER, marshal.dumps(config).hex()]
    return [unshare] + list(UNSHARE_OPTIONS) + command if unshare else command


class TraceSession:
    """What the runs of one trace or init command share: the temporary
    directory, the snapshot of the repository (copied once), the compiler
    shims (made again only after a run changed them), how scripts are
    isolated, and the checkout's state, which every run is checked
    against."""

    def __init__(self, repo):
        import shutil
        import tempfile
        self.root = repo.root
        self.top = os.path.realpath(tempfile.mkdtemp(prefix="check-contract-trace-"))
        self.snapshot = os.path.join(self.top, "snapshot")
        self.run_dir = os.path.join(self.top, "run")
        # The runs' copy of the snapshot, kept between runs that leave it as
        # it was made (copy_state) and made again after one that does not.
        self.copy, self.copy_state = os.path.join(self.top, "repo"), None
        self.toolkit = os.path.join(self.top, "toolkit")
        self.shims = None
        os.mkdir(self.snapshot)
        copy_repository(repo.root, self.snapshot)
        self.snapshot_state = tree_state(self.snapshot)
        self.root_dir = os.path.join(self.top, "root")  # where the launcher builds the script's /
        os.mkdir(self.root_dir)
        self.status = os.path.join(self.top, "status")
        # A home that does not exist, or that nothing bound holds, has nothing to hide.
        home = os.path.realpath(os.path.expanduser("~"))
        self.plan = isolation_plan(self.toolkit, [self.copy, self.run_dir], [
            os.path.realpath(repo.root), self.top] + ([home] if home != "/" else []))
        self.problem = namespace_problem(self.top)
        self.unshare = shutil.which("unshare") if self.problem is None else None
        # Compared after each run where the script can reach it: without namespaces.
        self.checkout = tree_state(repo.root) if self.unshare is None else None
        self.nvcc = MachineNvcc()

    def describe(self):
        """One line: how the scripts are isolated."""
        if self.problem is None:
            return "namespaces: " + isolation_words(self.plan, {
                self.toolkit: "<toolkit>", self.copy: "the repository's copy",
                self.run_dir: "the directory of <output-dir> (with the run's HOME and TMPDIR)"})
        return ("launcher only, no namespaces (%s): %s; of your environment it starts with only "
                "%s, every process it started is killed when it ends, and the checkout is "
                "compared with what it was" % (self.problem, UNISOLATED, kept_variables()))

    def shows(self, path):
        """Whether a script run in this session sees path."""
        return self.problem is not None or any(
            path == p or path.startswith(p.rstrip("/") + "/")
            for step, p, _ in self.plan if step in ("ro-bind", "bind", "symlink"))

    def close(self):
        if self.shims is not None:
            self.shims.close()
        remove_tree(self.top)


def repository_files(root):
    """Repository-relative paths of what a checkout holds: the files git
    lists (tracked, or untracked and not ignored), with those of each
    submodule checked out (a listed directory with a .git of its own);
    outside a git work tree, every file but those in .git."""
    import subprocess
    try:
        listed = subprocess.run(["git", "-C", root, "ls-files", "-z", "--cached", "--others",
                                 "--exclude-standard"], stdout=subprocess.PIPE,
                                stderr=subprocess.DEVNULL, check=False)
    except OSError:
        listed = None
    if listed is not None and listed.returncode == 0:
        paths = set()
        for rel in (os.fsdecode(p).rstrip("/") for p in listed.stdout.split(b"\0") if p):
            path = os.path.join(root, rel)
            if os.path.isdir(path) and not os.path.islink(path) and os.path.lexists(
                    os.path.join(path, ".git")):
                paths.update(os.path.join(rel, p) for p in repository_files(path))
            else:
                paths.add(rel)
        return sorted(paths)
    paths = []
    for top, dirs, files in os.walk(root):
        dirs[:] = [d for d in dirs if d != ".git"]
        rel = os.path.relpath(top, root)
        for name in files + [d for d in dirs if os.path.islink(os.path.join(top, d))]:
            paths.append(name if rel == "." else os.path.join(rel, name))
    return sorted(paths)


def copy_repository(root, copy):
    """Copy the repository's files into copy, modes kept.  A symbolic link
    is copied as a link, except that one leading into the repository by an
    absolute path leads, relatively, to the same place in the copy: nothing
    the script does reaches the repository, and a copy of the copy holds."""
    import shutil
    real_root = os.path.realpath(root)
    for rel in repository_files(root):
        source, target = os.path.join(root, rel), os.path.join(copy, rel)
        if not os.path.lexists(source):
            continue  # tracked, but deleted in the working tree
        os.makedirs(os.path.dirname(target), exist_ok=True)
        if os.path.islink(source):
            link = os.readlink(source)
            if os.path.isabs(link):
                real = os.path.realpath(link)
                if real == real_root or real.startswith(real_root + os.sep):
                    link = os.path.relpath(os.path.join(copy, os.path.relpath(real, real_root)),
                                           os.path.dirname(target))
            os.symlink(link, target)
        elif os.path.isfile(source):
            shutil.copy2(source, target)
    copy_git(root, copy)


def copy_git(root, copy):
    """Give the copy a .git of its own where root is the top of a git work
    tree, for a script that asks git its version (git describe, git
    rev-parse): a clone of the branch HEAD is on (its history and tags),
    made through git's transport (nothing shared with the checkout's
    objects), with neither the checkout's config (the credentials a
    checkout step persists there among it) nor a remote leading back to
    the checkout, and HEAD's tree as its index.  Where git cannot make it,
    the copy has none."""
    import shutil
    # No GIT_* variable of the caller's (a hook's GIT_DIR, GIT_INDEX_FILE)
    # reaches git: each call acts on the repository its arguments name.
    env = {k: v for k, v in os.environ.items() if not k.startswith("GIT_")}

    def git(*args):
        return run_git(None, *args, env=env)

    top = git("-C", root, "rev-parse", "--show-toplevel")
    if top is None or os.path.realpath(os.fsdecode(top.strip())) != os.path.realpath(root):
        return
    dot_git = os.path.join(copy, ".git")
    if git("clone", "--quiet", "--bare", "--single-branch", "--no-local", "--template=", "--",
           root, dot_git) is None:
        shutil.rmtree(dot_git, ignore_errors=True)
        return
    where = ("--git-dir=" + dot_git, "--work-tree=" + copy)
    git(*(where + ("config", "core.bare", "false")))
    git(*(where + ("config", "--remove-section", "remote.origin")))
    git(*(where + ("read-tree", "HEAD")))


def shim_library(exports=()):
    """The shared object a shim writes for -shared: an x86-64 ELF file whose
    dynamic symbol table defines the functions `exports` names (the ABI a
    script may look for with nm -D), in a one-byte code section named
    SHIM_SECTION (strip keeps it), with no program header: nm, strip and
    objdump accept it, and nothing can load it."""
    import struct
    names = b"\0.dynsym\0.dynstr\0" + SHIM_SECTION + b"\0.shstrtab\0"
    symbols, strings = bytes(24), b"\0"  # the null symbol; the empty name
    for name in exports:  # global functions at the start of the code section (index 3)
        symbols += struct.pack("<IBBHQQ", len(strings), 0x12, 0, 3, 0, 1)
        strings += name.encode() + b"\0"
    at_symbols = 64
    at_strings = at_symbols + len(symbols)
    at_code = (at_strings + len(strings) + 15) & ~15
    at_names = at_code + 1
    at_sections = (at_names + len(names) + 7) & ~7
    header = ELF_MAGIC + bytes([2, 1, 1, 0]) + bytes(8) + struct.pack(
        "<HHIQQQIHHHHHH", ELF_TYPE_SHARED, 62, 1, 0, 0, at_sections, 0, 64, 0, 0, 64, 5, 4)
    body = header + symbols + strings
    body += bytes(at_code - len(body)) + b"\xc3" + names  # the code: one ret
    body += bytes(at_sections - len(body))

    def section(name, kind, flags, offset, size, link=0, info=0, align=1, entsize=0):
        return struct.pack("<IIQQQQIIQQ", name, kind, flags, 0, offset, size, link, info, align,
                           entsize)
    return (body + bytes(64) + section(1, SECTION_DYNSYM, 2, at_symbols, len(symbols), 2, 1, 8, 24)
            + section(9, 3, 2, at_strings, len(strings)) + section(17, 1, 6, at_code, 1, align=16)
            + section(18 + len(SHIM_SECTION), 3, 0, at_names, len(names)))


SHIM_SECTION = b".check_contract_shim"


def read_bounded(path, cap):
    """(data, problem): at most cap bytes of a regular file, never through a
    link, never blocking; problem says why it is not (all) there."""
    try:
        fd = os.open(path, O_READ | getattr(os, "O_NOFOLLOW", 0))
    except OSError as exc:
        return None, "a link" if os.path.islink(path) else exc.strerror or str(exc)
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            return None, "not a regular file"
        chunks, size = [], 0
        while size <= cap:
            chunk = os.read(fd, min(READ_CHUNK, cap + 1 - size))
            if not chunk:
                break
            chunks.append(chunk)
            size += len(chunk)
    except OSError as exc:
        return None, exc.strerror or str(exc)
    finally:
        os.close(fd)
    data = b"".join(chunks)
    if len(data) > cap:
        return data[:cap], "larger than %d bytes" % cap
    return data, None


def read_calls(log):
    """(the RecordedCalls the shims recorded, in the order they were made;
    the log's entries that no shim wrote, with why)."""
    calls, odd = [], []
    try:
        if not stat.S_ISDIR(os.lstat(log).st_mode):
            return [], ["the log itself (not a directory)"]
        entries = os.listdir(log)
    except OSError as exc:
        return [], ["the log itself (%s)" % (exc.strerror or exc)]
    if len(entries) > TRACE_LOG_ENTRIES:
        return [], ["more than %d entries" % TRACE_LOG_ENTRIES]
    for entry in sorted(entries, key=call_order):
        data, problem = read_bounded(os.path.join(log, entry), TRACE_LOG_CAP)
        if problem is not None:
            odd.append("%s (%s)" % (entry, problem))
            continue
        fields = [os.fsdecode(f) for f in data.split(b"\0")[:-1]]
        count = int(fields[4]) if len(fields) > 5 and fields[4].isdigit() else -1
        if len(fields) < 6 + count or count < 0:
            odd.append("%s (not a shim's record)" % entry)
            continue
        row = compiler_row(fields[5])
        calls.append(RecordedCall(fields[5:6 + count], fields[1], fields[0] or None,
                                  {k: v for k, v in ((row.prepend, fields[2]),
                                                     (row.append, fields[3])) if k},
                                  fields[6 + count:]))
    return calls, odd


def call_order(name):
    """A recorded call's file is named <nanoseconds>.<pid> (where date knows
    %N; elsewhere the names still differ, and sort as found)."""
    return [int(part) if part.isdigit() else -1 for part in name.split(".")]


def read_xtrace(xtrace):
    """The command lines of bash's trace, and what is wrong with the file
    (None when nothing is; a trace too long is read in part)."""
    if not os.path.lexists(xtrace):
        return [], None  # no bash ran
    data, problem = read_bounded(xtrace, TRACE_XTRACE_CAP)
    lines = [] if data is None else [line for line in data.decode("utf-8", "replace").split("\n")
                                     if line.startswith("+")]
    return lines, problem if data is None else None


def xtrace_words(line):
    """The words of a command line of bash's trace, from the command on:
    VAR=value and wrapper words before it dropped."""
    import shlex
    try:
        words = shlex.split(line.lstrip("+"))
    except ValueError:
        words = line.lstrip("+").split()
    while words and (ENV_WORD_RE.match(words[0]) or words[0] in (
            "exec", "command", "env", "nohup", "time") + TRACE_WRAPPERS):
        words.pop(0)
    return words


def read_uncaught(lines, toolkit):
    """The compiler words bash ran by a path outside the shims' toolkit."""
    inside = os.path.realpath(toolkit) + os.sep
    found = []
    for line in lines:
        words = xtrace_words(line)
        if not words or "/" not in words[0]:
            continue
        word = words[0]
        if is_compiler_name(word) and word not in found \
                and not os.path.realpath(word).startswith(inside):
            found.append(word)
    return found


def written_files(out):
    """({path under out: size}, [the paths of ELF files], problem) of what the
    run left in out.  A shim writes no ELF file but shim_library()'s (stripped
    or not, its SHIM_SECTION names it): another was compiled by a program
    the shims did not stand in for.  No link is followed: out
    itself replaced by one is the problem, and nothing under it is read."""
    written, binaries = {}, []
    try:
        info = os.lstat(out)
    except OSError:
        return written, binaries, None  # the script made no <output-dir>
    if not stat.S_ISDIR(info.st_mode):
        return written, binaries, "<output-dir> itself (replaced by %s)" % (
            "a link" if stat.S_ISLNK(info.st_mode) else "a file")
    for top, dirs, files in os.walk(out):
        for name in files:
            path = os.path.join(top, name)
            rel = os.path.relpath(path, out)
            try:
                info = os.lstat(path)
            except OSError:
                continue
            written[rel] = info.st_size
            if stat.S_ISREG(info.st_mode) and info.st_size >= len(ELF_MAGIC):
                data, _ = read_bounded(path, READ_CHUNK)
                shim = b"\0" + SHIM_SECTION + b"\0"
                # A build system's probe is compiled by the real compiler (see TRACE_SHIM).
                if data and data[:len(ELF_MAGIC)] == ELF_MAGIC and shim not in data and \
                        not PROBE_PLACE_RE.search(rel):
                    binaries.append(rel)
    return written, sorted(binaries), None


def trace_script(session, backend, arch, timeout, stream):
    """Run the backend's build script under the session's shims, `<script>
    <out>` or, with arch, `<script> <out> <arch>`, on a copy of the snapshot
    as it was made (the last run's, where that run left it so; see
    copy_state), and return the Trace of that run."""
    import shutil
    top, copy = session.run_dir, session.copy
    out, home, tmp, log, xtrace = (os.path.join(top, n) for n in (
        "out", "home", "tmp", "calls", "xtrace"))
    try:
        os.mkdir(top)
        for path in (home, tmp, log):
            os.mkdir(path)
        if session.copy_state is None or copy_state(copy) != session.copy_state:
            remove_tree(copy)
            shutil.copytree(session.snapshot, copy, symlinks=True)
            session.copy_state = copy_state(copy)
        # A shim's library exports the backend's ABI, for a script that checks it with nm -D.
        prefix = backend.abi_prefix
        exports = (prefix + "_abi_version", prefix + "_error_string") if prefix else ()
        if session.shims is not None and session.shims.exports != exports:
            session.shims.close()
            session.shims = None
        if session.shims is None:  # the shims name the same log and xtrace paths every run
            session.shims = Shims(session.toolkit, log, xtrace, session.nvcc, exports)
        shims = session.shims
        bin_dir = os.path.join(shims.toolkit, "bin")
        env = {k: os.environ[k] for k in TRACE_KEPT_VARIABLES if k in os.environ}
        env["PATH"] = bin_dir + os.pathsep + env.get("PATH", os.defpath)
        env.update(HOME=home, TMPDIR=tmp, BASH_ENV=shims.bash_env)
        env.update((k, os.path.join(bin_dir, v)) for k, v in TRACE_COMPILER_VARIABLES)
        env.update((k, shims.toolkit) for k in TRACE_TOOLKIT_VARIABLES)
        script = backend.rel(backend.build_script)
        command = [os.path.join(copy, script), out] + ([arch] if arch is not None else [])
        places = [(out, "<output-dir>"), (shims.toolkit, "<toolkit>"), (copy, "."),
                  (home, "~"), (tmp, "$TMPDIR"), (top, "<output-dir>/.."),
                  (session.top, "<output-dir>/../..")]
        shown = " ".join(["./" + script, "<output-dir>"] + command[2:])
        stream.write("==> trace %s: %s\n" % (backend.key, shown))
        stream.flush()
        config = {"namespaces": session.unshare is not None, "root": session.root_dir,
                  "plan": session.plan, "cwd": copy, "command": command, "env": env,
                  "status": session.status}
        child = run_streaming(launcher_command(session.unshare, config), copy, timeout, stream,
                              env={}, show=lambda line: show_places(places, line))
        reason, _ = read_bounded(session.status, READ_CHUNK)
        kind, _, reason = (reason or b"").partition(b"\n")
        if kind == b"isolation":
            raise IsolationError(show_places(places, reason.decode("utf-8", "replace")))
        if reason and child.error is None:
            child.error = reason.decode("utf-8", "replace")
        written, binaries, out_problem = written_files(out)
        calls, odd = read_calls(log)
        lines, xtrace_problem = read_xtrace(xtrace)
        trace = Trace(shown, child, calls, read_uncaught(lines, shims.toolkit), written,
                      binaries, out, places)
        trace.commands = lines
        trace.search = [d for d in env["PATH"].split(os.pathsep) if session.shows(d)]
        for path in written:  # read now: <output-dir> is gone when the run is compared
            full = os.path.join(out, path)
            if os.path.islink(full) and not os.path.exists(full):
                trace.dangling[path] = show_places(places, os.readlink(full))
        trace.tampered = shims.changes()
        if trace.tampered:  # the next run gets shims made anew
            shims.close()
            session.shims = None
        trace.tampered += ["the call log's %s" % o for o in odd]
        trace.tampered += ["bash's trace (%s)" % xtrace_problem] if xtrace_problem else []
        trace.tampered += [out_problem] if out_problem else []
        snapshot = tree_state(session.snapshot)
        if snapshot != session.snapshot_state:
            trace.tampered.append("the trace's copy of the repository")
            remove_tree(session.snapshot)
            os.mkdir(session.snapshot)
            copy_repository(session.root, session.snapshot)
            session.snapshot_state = tree_state(session.snapshot)
            session.copy_state = None
        if session.checkout is not None:  # the script could reach the checkout
            checkout = tree_state(session.root)
            trace.changed = checkout_changes(session.checkout, checkout)
            session.checkout = checkout
        return trace
    finally:
        remove_tree(top)
        remove_tree(session.status)


def traced_facts(trace):
    """The ScriptFacts of a traced run: each recorded call read by
    compiler_call(), its outputs joined to the directory it ran in."""
    calls = []
    for recorded in trace.calls:
        call = recorded.facts()
        if call is not None:
            call.outputs = [posixpath.normpath(o) for o in call.outputs]
        calls.append(call)
    # What is in <output-dir> when the script ends is what it leaves there, however it got there.
    left = [("add", path, None, None) for path in sorted(trace.written)]
    facts = ScriptFacts([c for c in calls if c is not None], out_dir=trace.out_dir, placements=left)
    facts.dangling = trace.dangling
    return facts, calls


def traced_build(trace, calls, platform, library=None):
    """What a traced run did, as the report shows it: the command, each
    compiler call (words, directory, wrapper, outputs, targets), the library
    (the last output: "output" as shown, "landed" relative to <output-dir> or
    None when it is written elsewhere), the targets, the -D flags, the
    compilers run by a path the shims do not intercept, and the files left
    in <output-dir>."""
    shown, output, targets, ptx, defines = [], None, [], [], []
    linked = linked_calls([c for c in calls if c is not None], library)
    for recorded, call in zip(trace.calls, calls):
        words = [trace.show(w) for w in recorded.words]
        entry = {"words": words, "cwd": trace.show(recorded.cwd), "via": recorded.via,
                 "outputs": [], "targets": [], "ptx": [], "probe": True}
        if call is not None:
            entry.update(outputs=[trace.show(o) for o in call.outputs],
                         targets=list(call.targets(platform)), ptx=list(call.ptx),
                         probe=not call.outputs)
            output = entry["outputs"][-1] if call.outputs else output
            if call in linked:
                targets += [t for t in entry["targets"] if t not in targets]
                ptx += [t for t in call.ptx if t not in ptx]
        probe = call is not None and call.probes and not call.outputs  # it builds nothing
        for index, word in enumerate(words[1:] if not probe else (), 1):
            define = word if word.startswith("-D") and word != "-D" else (
                "-D" + words[index + 1] if word == "-D" and index + 1 < len(words) else None)
            if define is not None and define not in defines:
                defines.append(define)
        shown.append(entry)
    inside = "<output-dir>/"
    return {"command": trace.command, "elapsed": trace.child.elapsed, "calls": shown,
            "output": output,
            "landed": output[len(inside):] if output and output.startswith(inside) else None,
            "targets": targets, "ptx": ptx, "defines": defines, "uncaught": trace.uncaught,
            "written": sorted(trace.written)}


def trace_backend(repo, run, backend, args, stream, session):
    """Trace one backend's build script: its default invocation, and its
    single-target invocation for --arch, build.default_arch or the first of
    build.architectures; compare what they did with the manifest."""
    import copy
    import shutil
    key = backend.key
    script = backend.build_script
    # A manifest the check rejects (J, M) tells nothing to compare a run with.
    errors = [d for d in run.errors_of(backend) if d.code[0] in "JM"]
    if errors:
        diagnostic = Diagnostic("error", "R009", key, backend.rel(backend.name + MANIFEST_SUFFIX), None,
                                "not traceable: the contract check reports %d error(s) (%s); run "
                                "check_contract.py check %s" % (len(errors), ", ".join(sorted({
                                    d.code for d in errors})), key))
        return TierResult(key, "failed", diagnostic.message, diagnostics=[diagnostic])
    if script is None or not os.path.isfile(os.path.join(backend.dir, script)):
        return TierResult(key, "skipped", "no build script to trace (build.script %s); run "
                          "check_contract.py check %s" % ("is not given" if script is None
                                                          else "does not exist", key))
    if shutil.which("bash") is None:
        return TierResult(key, "skipped", "bash not found; trace runs build scripts with bash")
    platform = backend.platform if backend.platform in PLATFORMS else None
    arch = args.arch or backend.default_arch or (backend.architectures or [None])[0]
    found, runs = [], []
    for target in (None, arch) if arch is not None else (None,):
        trace = trace_script(session, backend, target, args.timeout, stream)
        facts, calls = traced_facts(trace)
        for call in facts.calls:
            call.rejected += session.nvcc.refusals(call)
        built = traced_build(trace, calls, platform, facts.library(backend.output))
        runs.append(built)
        said = "running %s shows: " % " ".join([script, "<output-dir>"] + (
            [target] if target is not None else []))

        def report(level, code, message):
            found.append(Diagnostic(level, code, key, backend.rel(script), None, said + message))

        if trace.changed:
            report("error", "X002", "the script changed the checkout: %s; a build script must "
                   "write only into its <output-dir> argument and temporary files"
                   % show_paths(trace.changed))
        if trace.tampered:
            report("error", "X004", "the script changed the trace's own files: %s; what it built "
                   "cannot be told" % show_paths(trace.tampered))
            continue
        for word in trace.uncaught:
            report("warning", "X001", "the script runs the compiler %s by its path, which the "
                   "trace cannot intercept; what that call built is not in this report (call it "
                   "by name, or through $NVCC/$CC/$CXX/$HIPCC or CUDA_HOME/ROCM_PATH)" % word)
        for binary in trace.binaries if not trace.uncaught else ():
            report("warning", "X001", "the script leaves <output-dir>/%s, a compiled file no shim "
                   "wrote: a compiler the trace cannot intercept made it (one run by its path, "
                   "from make or sh?); what that call built is not in this report" % binary)
        child = trace.child
        if child.error is not None:
            report("error", "R001", "the script cannot be run: %s" % child.error)
            continue
        if child.timed_out:
            report("error", "R002", "the script did not finish within %gs; it was stopped"
                   % args.timeout)
            continue
        if child.returncode != 0:
            limit = shim_limit(trace, facts)
            missing = missing_command(trace)
            if missing is not None:
                report("error", "R001", "the script failed with exit status %d: it runs %s, which "
                       "is not on its PATH" % (child.returncode, missing))
            elif limit is None:
                report("error", "R001", "the script failed with exit status %d" % child.returncode)
            else:
                report("warning", "X003", "the script failed with exit status %d, and %s: the "
                       "trace cannot tell whether it builds what the manifest says (build, with "
                       "the toolchain, can)" % (child.returncode, limit))
            continue
        checked = copy.copy(backend)
        checked.diagnostics = []
        if target is not None:  # the targets of a single-target run are checked below
            checked.architectures = None
        check_build_facts(checked, script, facts, traced=True)
        if target is None:
            check_compiled_sources(repo, checked, facts.calls, lambda path: None if trace.show(
                path).startswith(("<", "/", "~", "$")) else trace.show(path), traced=True,
                complete=not trace.uncaught and not trace.binaries, made=os.path.lexists)
        for d in checked.diagnostics:
            d.message = trace.show(d.message.replace("running %s shows: " % script, said, 1))
            found.append(d)
        if target is not None and facts.calls:
            if target not in built["targets"]:
                report("error", "B006", "the single-target invocation does not build %s" % target)
            for other in built["targets"]:
                if other != target:
                    report("error", "B007", "the single-target invocation for %s also builds "
                           "%s" % (target, other))
    result = TierResult(key, "failed" if any(d.level == "error" for d in found) else "passed",
                        trace_summary(runs[0]), sum(r["elapsed"] for r in runs), found)
    result.trace = runs
    return result


def missing_command(trace):
    """The command a run ran last when it ended with the shell's status for
    a command not found (127) and no directory on its PATH it could see
    holds that command, else None."""
    import shutil
    words = xtrace_words(trace.commands[-1]) if trace.commands else []
    if trace.child.returncode != 127 or not words or "/" in words[0]:
        return None
    return None if shutil.which(words[0], path=os.pathsep.join(trace.search)) else words[0]


def show_paths(paths, most=5):
    """Paths for a message: the first few, then how many more."""
    shown = ", ".join(paths[:most])
    return shown + (" and %d more" % (len(paths) - most) if len(paths) > most else "")


# Tools whose own compiler checks build and run test programs.
PROBING_TOOLS = ("cmake", "meson", "configure")
# Tools that read a compiled file, which a shim only stands in for.
INSPECTING_TOOLS = ("nm", "strip", "objdump", "readelf", "objcopy", "ldd", "file", "patchelf",
                    "cuobjdump", "nvdisasm")
VERSION_PROBES = ("--version", "-dumpversion", "-dumpfullversion", "-V")
SHIM_LIMIT_LINES = 3  # the last command lines of a failed run that may show a shim's limit
# Compiler flags (alone, or with =VALUE or ,VALUE) that leave files
# besides the output, which a shim does not write: intermediate files, split
# debug information, a linker map.
KEEPING_FLAGS = ("-keep", "--keep", "-save-temps", "--save-temps", "-gsplit-dwarf", "-Wl,-Map")


def shim_limit(trace, facts):
    """Why a run that failed may have failed for the shims and not for the
    script (it runs CMake; its last commands run or inspect what a shim
    wrote, or ask a compiler its version; it ends in a command after a
    compiler call that leaves files a shim does not write), or None."""
    made = {posixpath.basename(o) for call in facts.calls for o in call.outputs}
    parsed = [w for w in (xtrace_words(line) for line in trace.commands) if w]
    for words in parsed:
        if posixpath.basename(words[0]) in PROBING_TOOLS:
            return ("it runs %s, whose compiler checks build and run test programs that the "
                    "shims only stand in for" % posixpath.basename(words[0]))
    for words in parsed[-SHIM_LIMIT_LINES:]:
        first = posixpath.basename(words[0])
        if first in made and "/" in words[0]:
            return "it runs %s, which a shim wrote in place of compiling it" % trace.show(words[0])
        inspected = [w for w in words[1:] if posixpath.basename(w) in made]
        if first in INSPECTING_TOOLS and inspected:
            return "it runs %s on %s, which a shim wrote in place of compiling it" % (
                first, trace.show(inspected[0]))
        if is_compiler_name(words[0]) and any(w in VERSION_PROBES for w in words[1:]):
            return "it asks %s its version, which a shim answers" % trace.show(words[0])
    if parsed and not is_compiler_name(parsed[-1][0]):
        for call in trace.calls:
            kept = [w for w in call.words[1:] if any(w == f or w.startswith((f + "=", f + ","))
                                                     for f in KEEPING_FLAGS)]
            if kept:
                return ("its last command (%s) may need the files that %s %s leaves, which a shim "
                        "does not write" % (trace.show(" ".join(parsed[-1])),
                                            posixpath.basename(call.words[0]),
                                            trace.show(kept[0])))
    return None


def trace_summary(built):
    """One line: what a traced run built."""
    parts = ["%d compiler call(s)" % sum(1 for c in built["calls"] if not c["probe"])]
    if built["output"] is not None:
        parts.append("writes " + built["output"])
    if built["targets"]:
        parts.append("targets " + ", ".join(built["targets"]))
    if built["ptx"]:
        parts.append("PTX " + ", ".join(built["ptx"]))
    if built["defines"]:
        parts.append(" ".join(built["defines"]))
    return "; ".join(parts)


def report_tier(results, fmt, out, root, isolation=None):
    """The results of build, test, parity or trace: as JSON, or a line per
    backend (and per traced call) with its findings as text lines or GitHub
    annotations, then for trace the isolation used, then the counts."""
    counts = {o: sum(1 for r in results if r.outcome == o) for o in ("passed", "failed", "skipped")}
    if fmt == "json":
        found = dict({"results": [r.as_dict() for r in results]}, **counts)
        if isolation is not None:
            found["isolation"] = isolation
        json.dump(found, out, indent=2)
        out.write("\n")
        return
    locator = Locator(root)
    finding = annotation if fmt == "github" else lambda d: finding_line(d, locator)
    for result in results:
        line = "%s %s" % (result.outcome, result.backend)
        if result.detail:
            line += ": " + result.detail
        if result.elapsed is not None:
            line += " (%.1fs)" % result.elapsed
        out.write(escape_control(line) + "\n")
        for built in result.trace or ():
            out.write("  %s\n" % escape_control(built["command"]))
            for call in built["calls"]:
                out.write(escape_control("    %s%s  (in %s)" % (
                    "%s " % call["via"] if call["via"] else "", " ".join(call["words"]),
                    call["cwd"])) + "\n")
            out.write("    -> %s\n" % escape_control(trace_summary(built)))
        for d in result.diagnostics:
            out.write(finding(d))
    if isolation is not None:
        out.write("isolation: %s\n" % isolation)
    out.write("%(passed)d backend(s) passed, %(failed)d failed, %(skipped)d skipped" % counts)
    out.write(suppressed_note([d for r in results for d in r.suppressed]) + "\n")


def run_tier(args, run_one, choose=None, repo=None, isolation=None):
    repo = repo or repository(args)
    run = run_check(repo, args.names)
    backends = run.backends if choose is None else choose(run.backends, args.names)
    stream = tier_stream(args)
    if isolation is not None:
        stream.write("==> isolation: %s\n" % isolation)
    results = [run_one(repo, run, backend, args, stream) for backend in backends]
    # A directory the check takes for a backend without a manifest (D001 ...) is no
    # backend this tier can run: it fails, with the check's findings, never left out.
    found = {b.key for b in backends}
    unrun = collections.OrderedDict()
    for d in run.diagnostics:
        if "/" in d.backend and d.backend not in found and d.level == "error":
            unrun.setdefault(d.backend, []).append(d)
    results += [TierResult(key, "failed", "not a backend this tier can run: %s" % found_[0].message,
                           diagnostics=found_) for key, found_ in unrun.items()]
    for result in results:
        suppress(result.diagnostics, backends, args.ignore)
        result.suppressed = [d for d in result.diagnostics if d.suppressed is not None]
        result.diagnostics = [d for d in result.diagnostics if d.suppressed is None]
    report_tier(results, args.format, sys.stdout, repo.root, isolation)
    return 1 if any(r.outcome == "failed" for r in results) else 0



# ---------------------------------------------------------------------------
# Command line


def repository(args):
    """The Repository the command line names.  Without --root the root
    is found the way git finds its work tree: the top of the git work tree
    holding the current directory, else the nearest directory from here up
    that holds the backends directory."""
    given = args.backends_dir
    relative = posixpath.normpath(given.replace(os.sep, "/")) if given else ""
    if not given or os.path.isabs(given) or relative == ".." or relative.startswith("../"):
        raise UsageError("--backends-dir %s: give a directory relative to the repository root "
                         "and inside it (default: backends)" % (given or '""'))
    root = args.repo_root
    if root is not None:
        if not os.path.isdir(root):
            raise UsageError("--root %s: no such directory; give the repository root" % root)
        git = GitWorkTree.find(root)
    else:
        here = os.getcwd()
        git = GitWorkTree.find(here)
        root = git.top if git is not None else nearest_holding(here, relative) or here
    repo = Repository(root, relative, git)
    if git is None and in_git_work_tree(root):
        sys.stderr.write("check_contract.py: note: %s is in a git work tree but git cannot be run; "
                         "files git ignores are checked like the others, and B003 (the build "
                         "script's mode in the git index) is not checked\n" % root)
    if not os.path.isdir(repo.backends_path):
        if args.repo_root is not None:
            how = "given by --root"
        elif git is not None:
            how = "the top of the git work tree"
        else:
            how = "the current directory; no directory from here up holds %s/" % relative
        raise UsageError("no backends directory: %s is %s (the root is %s, %s); give --root "
                         "DIR (the directory that holds %s/) or --backends-dir DIR, or run from "
                         "inside the repository" % (
                             os.path.join(root, repo.backends_dir),
                             "not a directory" if os.path.lexists(repo.backends_path) else "not there",
                             root, how, relative))
    if not repo.inside(repo.backends_path):
        raise UsageError("--backends-dir %s leads to %s, outside the repository %s; the check "
                         "does not follow it" % (given, os.path.realpath(repo.backends_path), root))
    return repo


def in_git_work_tree(directory):
    """Whether a directory or one above it holds .git (a directory, or the
    file of a linked work tree)."""
    directory = os.path.abspath(directory)
    while not os.path.lexists(os.path.join(directory, ".git")):
        parent = os.path.dirname(directory)
        if parent == directory:
            return False
        directory = parent
    return True


def nearest_holding(directory, name):
    """The nearest of a directory and those above it holding `name`, or None."""
    while True:
        if os.path.isdir(os.path.join(directory, name)):
            return directory
        parent = os.path.dirname(directory)
        if parent == directory:
            return None
        directory = parent


def cmd_check(args):
    repo = repository(args)
    run = run_check(repo, args.names, args.ignore)
    REPORTERS[args.format](run, sys.stdout)
    if run.count("error") or (args.strict and run.count("warning")):
        return 1
    return 0


def buildable(run, backend):
    if backend.status in (None, "planned") or run.errors_of(backend):
        return False
    if backend.build_script is None:
        return False
    return os.access(os.path.join(backend.dir, backend.build_script), os.X_OK)


def cmd_list(args):
    repo = repository(args)
    run = run_check(repo)
    backends = [b for b in run.backends if not args.buildable or buildable(run, b)]
    rows = [{"name": b.name, "platform": b.platform, "dir": b.rel_dir,
             "status": b.status, "abi_version": b.abi_version,
             "script": b.rel(b.build_script) if b.build_script else None,
             "output": b.output, "architectures": b.architectures,
             "default_arch": b.default_arch} for b in backends]
    if args.format == "github-matrix":
        keys = ("name", "platform", "dir", "script", "output", "default_arch")
        json.dump({"include": [{k: row[k] for k in keys} for row in rows]}, sys.stdout,
                  separators=(",", ":"))
        sys.stdout.write("\n")
    elif args.format == "json":
        json.dump(rows, sys.stdout, indent=2)
        sys.stdout.write("\n")
    else:
        for row in rows:
            sys.stdout.write(escape_control("%s/%s platform=%s status=%s" % (
                row["platform"], row["name"], row["platform"], row["status"] or "?")) + "\n")
    return 0


TARGET_FLAGS = {"cuda": "-gencode, -arch or -code", "hip": "--offload-arch or -mcpu",
                "cpu": "-march"}


def inferred_build(script, facts, platform):
    """(build.output, build.architectures, where the library is written when
    that is not in <output-dir>, else None) as the facts of `script` show
    them; CannotTell names what cannot be told and what to write."""
    unfollowed = "".join("; the checker does not follow line %d (%s)" % item
                         for item in facts.unfollowed)
    outputs = [(output, call) for call in facts.calls for output in call.outputs]
    if not outputs:
        raise CannotTell("init: cannot tell from %s which library it writes: no compiler command "
                         "with -o%s; write the library with -o \"$1/<library>\", or write the "
                         "manifest yourself" % (script, unfollowed))
    output, call = outputs[-1]
    prefix = facts.out_dir + "/"
    if call.condition or UNDECIDED in output:
        raise CannotTell("init: cannot tell from %s which library it writes: -o %s at line %d "
                         "depends on %s; give build.output yourself"
                         % (script, show_word(output), call.line,
                            call.condition or "a value the checker cannot decide"))
    inside = output.startswith(prefix)
    library = output[len(prefix):] if inside else posixpath.basename(output)
    if any(m in library for m in MARKERS) or not library:
        raise CannotTell("init: cannot tell from %s which library it writes: it writes %s; write it "
                         "with -o \"$1/<library>\", or give build.output yourself"
                         % (script, show_path(output)))
    landed, maybe = facts.landing()
    if inside and posixpath.normpath(library) not in landed and not maybe:
        # Written, then moved or renamed: the library is the one it leaves there.
        libraries = sorted(p for p in landed if LIBRARY_NAME_RE.search(p))
        if len(libraries) != 1:
            raise CannotTell("init: cannot tell which library %s leaves in <output-dir>: it writes "
                             "%s with -o, then moves it, and leaves %s; give build.output yourself"
                             % (script, library, ", ".join(libraries) or "no library there"))
        library = libraries[0]
    archs, unknown, ptx = [], [], []
    for call in linked_calls(facts.calls, prefix + posixpath.normpath(library) if inside else output):
        if call.condition and call.targets(platform):
            unknown.append("line %d runs only on %s" % (call.line, call.condition))
        archs.extend(a for a in call.targets(platform) if a not in archs)
        unknown.extend(call.open_targets + call.unknown)
        ptx.extend(t for t in call.ptx if t not in ptx)
    if not unknown and not archs and ptx and platform == "cuda":
        unknown.append("it builds only PTX (%s), which is compiled when the library is loaded, "
                       "no machine code" % ", ".join("compute_" + t for t in ptx))
    if unknown or not archs:
        raise CannotTell("init: cannot tell which architectures %s builds (%s); give each target "
                         "in a flag of its own (%s) and run init again, or write the manifest "
                         "yourself" % (script, "; ".join(unknown) or "no target flag",
                                       TARGET_FLAGS.get(platform, "a target flag")))
    if platform == "cuda":
        archs.sort(key=lambda a: (arch_number(a) or 0, a))
    return posixpath.normpath(library), archs, None if inside else output


LIBRARY_NAME_RE = re.compile(r"\.(?:so|dylib|dll)(?:\.[0-9]+)*\Z")
# A command word written as an absolute path: at the start of a line or
# after ; & | then do else, past VAR=value words.
COMMAND_PATH_RE = re.compile(r"(?:^|[;&|]|\bthen\b|\bdo\b|\belse\b)[ \t]*(?:[A-Za-z_][A-Za-z0-9_]*="
                             r"[^ \t]*[ \t]+)*(/[^\s'\"`;&|()<>$]+)")


def compilers_by_path(text):
    """(line, word) of each compiler the script's text runs by an absolute
    path, which no shim stands in for."""
    found = []
    for number, line in enumerate(text.split("\n"), 1):
        if not line.lstrip().startswith("#"):
            found += [(number, w) for w in COMMAND_PATH_RE.findall(line) if is_compiler_name(w)]
    return found


def cmd_init(args):
    import shutil
    repo = repository(args)
    target = os.path.abspath(args.dir)
    if not os.path.isdir(target):
        raise UsageError("init %s: no such directory; give the directory of the backend's "
                         "sources, %s/<platform>/<name>" % (args.dir, repo.backends_dir))
    backends_abs = os.path.abspath(repo.backends_path)
    parent = os.path.dirname(os.path.dirname(target))
    if parent != backends_abs:
        raise UsageError("init %s: not a backend directory; give %s/<platform>/<name> under the "
                         "repository root (--root %s)"
                         % (args.dir, repo.backends_dir, repo.root))
    name = os.path.basename(target)
    platform = os.path.basename(os.path.dirname(target))
    manifest_path = os.path.join(target, name + MANIFEST_SUFFIX)
    if os.path.lexists(manifest_path) and not args.force:
        raise UsageError("init: %s already exists; use --force to overwrite it"
                         % os.path.relpath(manifest_path))
    files = walk_files(target, ignored=ignore_function(repo, target))  # no generated file git ignores
    real_target = os.path.realpath(target)
    # A link to a file inside the directory is a source like any other (the check wants it declared).
    sources = sorted(p for p in files if (files[p] == "file" or files[p] == "link" and os.path.isfile(
        target + "/" + p) and os.path.realpath(target + "/" + p).startswith(real_target + "/"))
                     and is_kernel_source(p)
                     and not p.rsplit("/", 1)[-1].startswith("test_")
                     and "tests" not in p.split("/")[:-1])
    if not sources:
        raise CannotTell("init %s: no kernel sources (%s) found" % (args.dir, " ".join(KERNEL_SUFFIXES)))
    scripts = sorted(p for p in files if "/" not in p and p.endswith(".sh"))
    if not scripts:
        raise CannotTell("init %s: no build script (*.sh) found; write one taking "
                         "<output-dir> [<arch>] first" % args.dir)
    if "build.sh" not in scripts and len(scripts) > 1:
        raise CannotTell("init %s: cannot tell which script builds the backend: %s; name it "
                         "build.sh, or write the manifest yourself" % (args.dir, ", ".join(scripts)))
    script = "build.sh" if "build.sh" in scripts else scripts[0]
    text, problem, _ = read_text(os.path.join(target, script))
    if text is None:
        raise CannotTell("init: cannot read %s: %s" % (script, problem))
    facts = ScriptReader(text, target).facts()
    rel_dir = posixpath.join(repo.backends_dir, platform, name)
    backend = Backend(name, platform, target, rel_dir)
    backend.build_script = script
    said = sys.stderr if args.format == "json" else sys.stdout
    traced = not args.no_trace and shutil.which("bash") is not None
    if traced:
        check_shebang(backend, script, text, script)
        for d in backend.diagnostics:
            raise CannotTell("init: %s (%s); or give --no-trace to read it without running it"
                             % (d.message, d.code))
        for number, word in compilers_by_path(text):
            raise CannotTell("init: %s line %d runs the compiler %s by its path, which the "
                             "trace cannot intercept (X001); call it by name or through "
                             "$NVCC/$CC/$CXX/$HIPCC, or give --no-trace to read the script "
                             "without running it" % (script, number, word))
        if script != "build.sh":
            said.write("init: %s is the only *.sh here, so build.script; running ./%s "
                       "<output-dir> with the compiler shims in place\n"
                       % (script, backend.rel(script)))
        facts, show = init_trace(repo, backend, facts.default_target)
    try:
        output, archs, elsewhere = inferred_build(script, facts, platform)
    except CannotTell as exc:  # its words are the traced calls', temporary paths in them
        raise CannotTell(show(str(exc)) if traced else str(exc))
    abi = 1
    for source in sources:
        text, _, _ = read_text(os.path.join(target, source))
        found = [d for d in find_abi_defines(strip_c_comments(text or "")) if d[1] is not None]
        if found:
            abi = found[0][1]
            break
    if platform == "cuda":
        archs = [int(a) if a.isdigit() and len(a) <= MAX_DIGITS else a for a in archs]
    build = {"script": script, "output": output, "architectures": archs}
    default = facts.default_target
    if default is None and len(archs) == 1:
        default = str(archs[0])
    if default is not None:
        build["default_arch"] = (int(default) if platform == "cuda" and default.isdigit()
                                 and len(default) <= MAX_DIGITS else default)
    manifest = {"name": name, "platform": platform, "status": "experimental", "abi_version": abi,
                "sources": sources, "build": build}
    kept = replaced_ignore(manifest_path) if args.force else {}
    if kept:
        manifest["ignore"] = kept
    schema = os.path.join(repo.backends_path, "backend.schema.json")
    if os.path.isfile(schema):  # a $schema naming no file would mislead editors
        manifest = dict({"$schema": posixpath.relpath(schema, target).replace(os.sep, "/")}, **manifest)
    take_manifest(backend, manifest)
    check_keys(repo, backend)
    rejected = [d.message for d in backend.diagnostics if d.level == "error"]
    if rejected:
        raise CannotTell("init: the manifest inferred from %s would not pass the check: %s; "
                         "nothing was written" % (args.dir, "; ".join(rejected)))
    temporary = manifest_path + ".tmp"
    created = False
    try:
        with open(temporary, "x", encoding="utf-8") as handle:  # never through a link
            created = True
            json.dump(manifest, handle, indent=2)
            handle.write("\n")
        os.replace(temporary, manifest_path)
    except OSError as exc:
        if isinstance(exc, FileExistsError):
            reason = "%s is in the way; remove it" % os.path.relpath(temporary)
        else:
            reason = "%s (%s)" % (exc.strerror or exc, os.path.relpath(exc.filename or temporary))
        if created:
            os.unlink(temporary)
        sys.stderr.write("check_contract.py: error: init: cannot write %s: %s; nothing was "
                         "written\n" % (os.path.relpath(manifest_path), reason))
        return 1
    said.write("wrote %s%s\n" % (
        os.path.relpath(manifest_path),
        " (keeping the ignore entries of the one it replaced: %s)" % ", ".join(sorted(kept))
        if kept else ""))
    run = run_check(repo, [platform + "/" + name])
    REPORTERS[args.format](run, sys.stdout)
    if elsewhere is not None:
        said.write("init: %s writes its library to %s, not into its <output-dir> argument, where "
                   "the build tier and CI look for it: write it with -o \"$1/%s\"\n"
                   % (script, show_word(elsewhere) if traced else show_path(elsewhere), output))
    return 1 if run.count("error") or elsewhere is not None else 0


def replaced_ignore(path):
    """The valid "ignore" entries of the manifest that init --force
    replaces: why a warning is accepted is nothing the directory tells."""
    text = read_text(path)[0]
    try:
        old = json.loads(text) if text else None
    except (ValueError, RecursionError):
        return {}
    ignore = old.get("ignore") if isinstance(old, dict) else None
    return {code: why for code, why in sorted(ignore.items())
            if CODE_RE.match(code) and REASON.test(why)} if isinstance(ignore, dict) else {}


def init_trace(repo, backend, default_target):
    """The ScriptFacts of the backend's build script run under the compiler
    shims, for init, paths shown as the repository's or <output-dir>, and
    the run's show(), for the words of a message read from them;
    CannotTell when the run does not show them."""
    import io
    script = backend.build_script
    output = io.StringIO()
    session = TraceSession(repo)
    try:
        trace = trace_script(session, backend, None, TRACE_TIMEOUT, output)
    finally:
        session.close()
    child = trace.child
    # A real compiler run by its path fails or succeeds on its own: that is
    # what to say, whatever happened next.
    uncaught = ("runs the compiler %s by its path, which the trace cannot intercept"
                % ", ".join(trace.uncaught) if trace.uncaught else "leaves <output-dir>/%s, a "
                "compiled file no shim wrote: a compiler the trace cannot intercept made it"
                % trace.binaries[0] if trace.binaries else None)
    if uncaught:
        raise CannotTell("init: %s %s (X001); call it by name or through $NVCC/$CC/$CXX/$HIPCC, "
                         "or give --no-trace to read the script without running it"
                         % (script, uncaught))
    if trace.tampered or trace.changed:
        raise CannotTell("init: %s changed %s while it ran; init cannot tell what it builds"
                         % (script, show_paths(trace.tampered + trace.changed)))
    facts, _ = traced_facts(trace)
    failure = (child.error if child.error is not None else
               "it did not finish within %gs" % TRACE_TIMEOUT if child.timed_out else
               "it failed with exit status %d" % child.returncode if child.returncode else None)
    missing = missing_command(trace) if failure is not None else None
    if missing is not None:
        raise CannotTell("init: %s runs %s, which is not on its PATH (exit status %d); install it "
                         "where the script finds it, or give --no-trace to read the script "
                         "without running it" % (script, missing, child.returncode))
    if failure is not None:
        limit = shim_limit(trace, facts) if child.returncode else None
        if limit is not None:
            raise CannotTell("init: cannot tell what %s builds: %s, and %s; write the manifest "
                             "yourself and check it with build, or give --no-trace to read the "
                             "script without running it" % (script, failure, limit))
        # The script's last line of output, without the elapsed time before it.
        said = [line.split("] ", 1)[-1] for line in output.getvalue().splitlines()[1:]]
        said = [line for line in said if line.strip()]
        raise CannotTell("init: %s cannot be run with the compiler shims in place (%s%s); make it "
                         "run as ./%s <output-dir>, or give --no-trace to read it without running "
                         "it" % (script, failure, ": " + said[-1] if said else "", script))
    for call in facts.calls:
        call.outputs = [trace.show(o) for o in call.outputs]
    facts.out_dir = "<output-dir>"
    facts.default_target = default_target
    return facts, trace.show


def cmd_build(args):
    if args.arch is not None and not args.arch.strip():
        raise UsageError("--arch must name an architecture, e.g. --arch 90")
    return run_tier(args, build_backend)


def cmd_test(args):
    return run_tier(args, test_backend)


def cmd_trace(args):
    if args.arch is not None and not args.arch.strip():
        raise UsageError("--arch must name an architecture, e.g. --arch 90")
    repo = repository(args)
    session = TraceSession(repo)
    try:
        return run_tier(args, lambda *a: trace_backend(*a, session=session), repo=repo,
                        isolation=session.describe())
    finally:
        session.close()


def cmd_parity(args):
    def choose(backends, names):
        return backends if names else [b for b in backends if b.status == "validated"]
    return run_tier(args, parity_backend, choose)


def positive_seconds(text):
    try:
        value = float(text)
    except ValueError:
        value = 0
    if not value > 0:
        raise argparse.ArgumentTypeError("must be a number of seconds > 0, not %r" % text)
    return value


class CommandLineError(UsageError):
    """A command line argparse cannot read; main() adds where the usage is."""


class Parser(argparse.ArgumentParser):
    def error(self, message):
        raise CommandLineError(message)  # one line, not argparse's usage dump


# The formats of each command; where github is one, it is the default when
# GITHUB_ACTIONS=true, as GitHub sets it in every job.
FORMATS = {"check": ("text", "json", "github", "sarif"), "list": ("text", "json", "github-matrix"),
           "init": ("text", "json", "github"), "build": ("text", "json", "github"),
           "test": ("text", "json", "github"), "parity": ("text", "json", "github"),
           "trace": ("text", "json", "github")}


def add_format(parser, name, help_text):
    """--format, and --json as its alias (both tools take both)."""
    parser.add_argument("--format", choices=FORMATS[name], default=None, help=help_text)
    parser.add_argument("--json", action="store_true", help="same as --format json")


def add_ignore(parser):
    parser.add_argument("--ignore", metavar="CODE", action="append", type=diagnostic_code,
                        default=[], help="suppress the warnings of this code (repeat it for "
                        "more); they are counted as suppressed, never dropped")


def diagnostic_code(text):
    if not CODE_RE.match(text):
        raise argparse.ArgumentTypeError("%r is no diagnostic code; give one such as B017 (a "
                                         "letter and three digits)" % text)
    return text


def resolve_format(args):
    if getattr(args, "json", False):
        if args.format not in (None, "json"):
            raise UsageError("--json and --format %s ask for two formats; give one" % args.format)
        args.format = "json"
    if args.format is None:
        args.format = ("github" if "github" in FORMATS[args.command]
                       and os.environ.get("GITHUB_ACTIONS") == "true" else "text")


ROOT_HELP = ("repository root (default: the top of the git work tree here, else the nearest "
             "directory from here up holding the backends directory)")


def build_parser(only=None):
    """The command-line parser; with `only`, the parser of that subcommand
    alone (a command line that names one needs no other, and building them
    all costs more than checking a few backends)."""
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--root", dest="repo_root", metavar="DIR", default=argparse.SUPPRESS,
                        help=ROOT_HELP)
    common.add_argument("--repo-root", dest="repo_root", default=argparse.SUPPRESS,
                        help=argparse.SUPPRESS)
    common.add_argument("--backends-dir", metavar="DIR", default=argparse.SUPPRESS,
                        help="backends directory relative to the root (default: backends)")
    formatter = argparse.RawDescriptionHelpFormatter
    parser = Parser(prog="check_contract.py", formatter_class=formatter,
                    description="Check that each backend's manifest tells the truth about its "
                    "directory; build, test and compare backends.", epilog=HELP_EXAMPLES)
    parser.add_argument("--version", action="version", version="%(prog)s " + VERSION)
    parser.add_argument("--root", dest="repo_root", metavar="DIR", default=None, help=ROOT_HELP)
    parser.add_argument("--repo-root", dest="repo_root", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--backends-dir", metavar="DIR", default="backends",
                        help="backends directory relative to the root (default: backends)")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=Parser)
    if only in (None, "check"):
        add_check_parser(sub, common, formatter)
    if only in (None, "list", "init", "build"):
        add_other_parsers(sub, common, formatter, only)
    if only in (None, "test", "parity"):
        add_tier_parsers(sub, common, formatter, only)
    if only in (None, "trace"):
        add_trace_parser(sub, common, formatter)
    return parser


def add_check_parser(sub, common, formatter):
    check = sub.add_parser("check", parents=[common], formatter_class=formatter,
                           help="check the manifests against their directories (default)",
                           description="Check every backend's manifest against its directory.",
                           epilog="examples:\n"
                           "  python3 check_contract.py --root .\n"
                           "  python3 check_contract.py check --format json cpu/llm_ops\n"
                           "  python3 check_contract.py check --strict --format github\n"
                           "  python3 check_contract.py check --ignore B017 --format sarif > check.sarif\n")
    add_format(check, "check", "output format; sarif: SARIF 2.1.0 for GitHub code scanning "
               "(default: github when GITHUB_ACTIONS=true, else text)")
    check.add_argument("--strict", action="store_true", help="warnings fail the check too")
    add_ignore(check)
    check.add_argument("names", nargs="*", metavar="NAME", help="backends to check (default: all)")


def add_other_parsers(sub, common, formatter, only):
    """The list, init and build subcommands (or the one of them named)."""
    if only in (None, "list"):
        add_list_parser(sub, common, formatter)
    if only in (None, "init"):
        add_init_parser(sub, common, formatter)
    if only in (None, "build"):
        add_build_parser(sub, common, formatter)


def add_list_parser(sub, common, formatter):
    listing = sub.add_parser("list", parents=[common], formatter_class=formatter,
                             help="list the discovered backends",
                             description="List the discovered backends with platform and status.",
                             epilog="examples:\n"
                             "  python3 check_contract.py list\n"
                             "  python3 check_contract.py list --buildable --format github-matrix\n")
    listing.add_argument("--buildable", action="store_true",
                         help="only non-planned backends with no errors and an executable build script")
    add_format(listing, "list",
               "output format: one line per backend, every field as JSON, or a GitHub Actions "
               "job matrix (default: text)")


def add_init_parser(sub, common, formatter):
    init = sub.add_parser("init", parents=[common], formatter_class=formatter,
                          help="write a manifest inferred from a backend directory",
                          description="Write DIR/<name>.backend.json inferred from the directory "
                          "(sources, ABI version, build script), status experimental, then check it. "
                          "What the build script builds is learnt by running it as trace does, with "
                          "compiler shims in place (--no-trace: by reading it). Nothing is written "
                          "when a value cannot be told (exit 1); the message says which and what to "
                          "write. A library written outside <output-dir> is written down by its "
                          "name, and the fix to the script is said (exit 1).",
                          epilog="examples:\n"
                          "  python3 check_contract.py init backends/cuda/flash_attn\n"
                          "  python3 check_contract.py init --force backends/cpu/llm_ops\n")
    init.add_argument("dir", metavar="DIR", help="the backend directory")
    init.add_argument("--force", action="store_true", help="overwrite an existing manifest")
    init.add_argument("--no-trace", action="store_true",
                      help="read the build script without running it (by default, when bash "
                      "is here, init runs it as trace does, with compiler shims in place)")
    add_format(init, "init", "the format of the check report after the manifest is written; "
               "json: the 'wrote' line goes to stderr (default: github when GITHUB_ACTIONS=true, "
               "else text)")


def add_build_parser(sub, common, formatter):
    build = sub.add_parser("build", parents=[common], formatter_class=formatter,
                           help="build backends and inspect the libraries they write",
                           description="Run each buildable backend's build script (skipped when its "
                           "toolchain is missing), then check that build.output is an ELF shared "
                           "object exporting <prefix>_abi_version and <prefix>_error_string, that "
                           "<prefix>_abi_version() returns abi_version, and that its GPU code is for "
                           "exactly build.architectures (cuda: the SASS in its fatbinary; hip: the "
                           "code objects in its offload bundles).",
                           epilog="examples:\n"
                           "  python3 check_contract.py build\n"
                           "  python3 check_contract.py build cuda/llm_ops --arch 90 --out /tmp/out\n"
                           "  python3 check_contract.py build --format json > build.json\n")
    build.add_argument("names", nargs="*", metavar="NAME", help="backends to build (default: all)")
    build.add_argument("--out", metavar="DIR", default=None,
                       help="output root; each backend builds into DIR/<platform>/<name> "
                       "(default: <root>/build/backends)")
    build.add_argument("--arch", metavar="A", default=None,
                       help="build only this architecture (passed as the script's second argument)")
    build.add_argument("--timeout", metavar="S", type=positive_seconds, default=1800.0,
                       help="time limit per build in seconds (default: 1800)")
    add_format(build, "build", "output format; json: results on stdout, build output on stderr "
               "(default: github when GITHUB_ACTIONS=true, else text)")
    add_ignore(build)


def add_tier_parsers(sub, common, formatter, only):
    """The test and parity subcommands (or the one of them named)."""
    for name, what, description, example in (
            ("test", "run each backend's tests beside its kernels",
             "Run python3 -m unittest discover -v -s <backend-dir> -t <backend-dir> for each "
             "backend, from the repository root. A non-planned backend without tests gets a warning.",
             "  python3 check_contract.py test\n  python3 check_contract.py test cpu/llm_ops\n"),
            ("parity", "run the reference entrypoint of validated backends",
             "Run reference.entrypoint of each validated backend (or of each backend named) and "
             "report passed, failed, or skipped when its first output line is SKIP: <reason> and "
             "it exits 0.",
             "  python3 check_contract.py parity\n  python3 check_contract.py parity cuda/llm_ops\n")):
        if only not in (None, name):
            continue
        tier = sub.add_parser(name, parents=[common], formatter_class=formatter, help=what,
                              description=description, epilog="examples:\n" + example)
        tier.add_argument("names", nargs="*", metavar="NAME", help="backends to run (default: %s)"
                          % ("the validated ones" if name == "parity" else "all"))
        tier.add_argument("--timeout", metavar="S", type=positive_seconds, default=1800.0,
                          help="time limit per backend in seconds (default: 1800)")
        add_format(tier, name, "output format; json: results on stdout, child output on stderr "
                   "(default: github when GITHUB_ACTIONS=true, else text)")
        add_ignore(tier)


def add_trace_parser(sub, common, formatter):
    trace = sub.add_parser(
        "trace", parents=[common], formatter_class=formatter,
        help="run build scripts with compiler shims and check what they build",
        description="Run each backend's build script as CI would (<script> <output-dir>, then "
        "<script> <output-dir> <arch>) on a temporary copy of the repository, with every "
        "compiler replaced by a shim that records its arguments and creates the files the "
        "compiler would (-o's, or named after its inputs; -MD's depfiles); "
        "report the compiler calls, where the library lands, its targets and -D flags, and "
        "check the manifest against them with the codes of the contract check. No toolchain "
        "is needed. The script itself runs (with bash, in an environment holding only PATH, "
        "the locale, HOME and TMPDIR in the temporary directory, and the compiler variables), "
        "where the machine allows it in namespaces, in a root of its own where only the "
        "system's directories are read-only and only the repository's copy and <output-dir> "
        "writable, with no network; else (or with CHECK_CONTRACT_NO_NAMESPACES=1) as you, "
        "from a launcher that kills all it started, the checkout compared with what it was "
        "before (a change is X002). The isolation used, and so what the script can reach, is "
        "the report's last line but one; exit status 3 (X005) when it cannot be set up.",
        epilog="examples:\n"
        "  python3 check_contract.py trace\n"
        "  python3 check_contract.py trace cuda/llm_ops --arch 89\n"
        "  python3 check_contract.py trace --format json > trace.json\n")
    trace.add_argument("names", nargs="*", metavar="NAME", help="backends to trace (default: all)")
    trace.add_argument("--arch", metavar="A", default=None,
                       help="the target of the single-target run (default: build.default_arch, "
                       "else the first of build.architectures)")
    trace.add_argument("--timeout", metavar="S", type=positive_seconds, default=TRACE_TIMEOUT,
                       help="time limit per run of a script in seconds (default: 120)")
    add_format(trace, "trace", "output format; json: results on stdout, script output on "
               "stderr (default: github when GITHUB_ACTIONS=true, else text)")
    add_ignore(trace)


ROOT_OPTIONS = ("--root", "--repo-root", "--backends-dir")
COMMANDS = {"check": cmd_check, "list": cmd_list, "init": cmd_init, "build": cmd_build,
            "test": cmd_test, "parity": cmd_parity, "trace": cmd_trace}


# Options of the subcommands that may also come before the command; they are
# moved after it, where its parser reads them.
MOVED_OPTIONS = ("--format",)
MOVED_FLAGS = ("--json",)


def with_default_command(argv):
    """(argv with `check` inserted when no subcommand is named and the
    options of the subcommands given before it moved after it, the
    subcommand, or None for a command line that asks for help or version)."""
    head, moved = [], []
    index = 0
    while index < len(argv):
        arg = argv[index]
        if arg in ROOT_OPTIONS + MOVED_OPTIONS:
            if index + 1 == len(argv):
                break  # no value: the parser says so
            (moved if arg in MOVED_OPTIONS else head).extend(argv[index:index + 2])
            index += 2
        elif arg.startswith(tuple(option + "=" for option in ROOT_OPTIONS + MOVED_OPTIONS)) \
                or arg in MOVED_FLAGS:
            (head if arg.startswith(tuple(o + "=" for o in ROOT_OPTIONS)) else moved).append(arg)
            index += 1
        elif arg in COMMANDS:
            return head + [arg] + moved + argv[index + 1:], arg
        elif arg in ("-h", "--help", "--version"):
            return argv, None
        else:
            break
    return head + ["check"] + moved + argv[index:], "check"


class ReportError(Exception):
    """Standard output cannot be written (a full disk, a closed pipe)."""


class GuardedOutput:
    """Standard output, whose write errors become ReportError, so that they
    are told from the errors of the files the checks read."""

    def __init__(self, stream):
        self.stream = stream

    def write(self, text):
        try:
            return self.stream.write(text)
        except OSError as exc:
            raise ReportError(exc.strerror or str(exc)) from None

    def flush(self):
        try:
            self.stream.flush()
        except OSError as exc:
            raise ReportError(exc.strerror or str(exc)) from None

    def __getattr__(self, name):
        return getattr(self.stream, name)


def discard_output(stream):
    """Send what is left of a stream that cannot be written to /dev/null,
    so that nothing more fails when the interpreter flushes it at exit."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, stream.fileno())
        os.close(devnull)
    except (OSError, AttributeError, ValueError):  # not a file (a test's StringIO)
        pass


def main(argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    for stream in (sys.stdout, sys.stderr):  # a name the terminal cannot show is escaped
        if hasattr(stream, "reconfigure"):
            stream.reconfigure(errors="backslashreplace")
    stdout = sys.stdout
    sys.stdout = GuardedOutput(stdout)
    command = None
    try:
        argv, command = with_default_command(argv)
        args = build_parser(command).parse_args(argv)
        resolve_format(args)
        status = COMMANDS[args.command](args)
        sys.stdout.flush()
        return status
    except CommandLineError as exc:
        sys.stderr.write("check_contract.py: error: %s; see check_contract.py %s--help\n"
                         % (exc, command + " " if command else ""))
        return 2
    except UsageError as exc:
        sys.stderr.write("check_contract.py: error: %s\n" % escape_control(str(exc)))
        return 2
    except CannotTell as exc:
        sys.stderr.write("check_contract.py: error: %s\n" % escape_control(str(exc)))
        return 1
    except IsolationError as exc:
        sys.stderr.write("check_contract.py: error: X005 the trace's isolation cannot be set up "
                         "(%s); the build script was not run: this is the checker's failure, not "
                         "the script's; %s=1 traces without namespaces\n"
                         % (escape_control(str(exc)), NO_NAMESPACES_VARIABLE))
        return 3
    except ReportError as exc:
        discard_output(stdout)
        try:
            sys.stderr.write("check_contract.py: error: cannot write to standard output: %s; the "
                             "report is incomplete\n" % exc)
        except OSError:  # stderr went with it
            pass
        return 2
    except SystemExit as exc:
        return exc.code if isinstance(exc.code, int) else 0
    except KeyboardInterrupt:
        sys.stderr.write("check_contract.py: interrupted\n")
        return 130
    finally:
        sys.stdout = stdout


if __name__ == "__main__":
    sys.exit(main())
