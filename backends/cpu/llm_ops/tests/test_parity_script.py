"""parity.py, the manifest's reference.entrypoint, run as CI runs it."""

import json
import os
import subprocess
import sys
import unittest

BACKEND_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(BACKEND_DIR)))


class ParityScriptTest(unittest.TestCase):
    def test_entrypoint_passes_and_reports_every_declared_op(self):
        with open(os.path.join(BACKEND_DIR, "llm_ops.backend.json")) as f:
            manifest = json.load(f)
        result = subprocess.run([sys.executable, manifest["reference"]["entrypoint"]],
                                cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                universal_newlines=True)
        self.assertEqual(result.returncode, 0, result.stdout + result.stderr)
        lines = result.stdout.splitlines()
        reported = {line.split()[0]: line.split()[-1] for line in lines[1:-1]}
        declared = set(manifest["numerics"]["tolerance"]) - {"note"}
        self.assertEqual(reported, {op: "ok" for op in declared})
        self.assertEqual(lines[-1], "%d op(s), 0 failure(s)" % len(declared))

    def test_unknown_option_is_a_usage_error(self):
        result = subprocess.run([sys.executable, os.path.join(BACKEND_DIR, "parity.py"),
                                 "--arch", "90"], stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, universal_newlines=True)
        self.assertEqual(result.returncode, 2)
        self.assertIn("unrecognized arguments: --arch", result.stderr)


if __name__ == "__main__":
    unittest.main()
