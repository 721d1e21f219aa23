#!/usr/bin/env python3
"""Run `python3 -m unittest -v MODULE` for each MODULE, all at once.

The two test files take about as long as each other, and much of each is
spent waiting for a build or a child process: run one after the other, they
leave a CPU of a 2-core machine idle, and beside other work they get one
CPU's share where two processes would get more.

The first module's output is shown as it comes; each other module's output
follows, whole, once it has finished (interleaved, the -v listings would not
say which result is whose). Exit status: 0 when every module passed, else
that of the first module that failed (1 for one ended by a signal); 130 when
interrupted.
"""
import subprocess
import sys
import tempfile


def main(modules):
    if not modules:
        sys.stderr.write("usage: python3 .ci/unittest_at_once.py MODULE [MODULE ...]\n")
        return 2
    command = [sys.executable, "-m", "unittest", "-v"]
    logs = [tempfile.TemporaryFile() for _ in modules[1:]]
    later = [subprocess.Popen(command + [module], stdout=log, stderr=subprocess.STDOUT)
             for module, log in zip(modules[1:], logs)]
    try:
        statuses = [subprocess.call(command + modules[:1])]
        for process, log in zip(later, logs):
            statuses.append(process.wait())
            log.seek(0)
            sys.stderr.flush()
            sys.stderr.buffer.write(log.read())
            sys.stderr.flush()
    except KeyboardInterrupt:  # the modules got the signal too, being in our process group
        for process in later:
            process.wait()
        sys.stderr.write("interrupted\n")
        return 130
    failed = [status for status in statuses if status != 0]
    return (failed[0] if failed[0] > 0 else 1) if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
