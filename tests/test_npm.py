"""The npm launcher (npm/bin/*.js), run by the real `node` against the checkout.

The launcher must answer --version and --help by itself, find a Python that
can import tc_mcp (TC_PYTHON first, then python3/python on PATH, then the
tc-mcp command a pipx install puts on PATH), hand stdio
through to `python -m tc_mcp`, forward signals and the exit code, and, with no
suitable Python, say how to install the server and exit 1 without a stack
trace. Skipped when node is not installed.
"""

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import unittest

from support import REPO, SCRIPTS, clean_env

NODE = shutil.which("node")
PACKAGE_JSON = os.path.join(REPO, "npm", "package.json")
TIMEOUT = 60
STACK_LINE = re.compile(r"^\s+at\s", re.MULTILINE)


def launcher_path():
    with open(PACKAGE_JSON, encoding="utf-8") as fh:
        bin_entry = json.load(fh)["bin"]
    rel = bin_entry if isinstance(bin_entry, str) else bin_entry["task-checkpoint-mcp"]
    return os.path.join(REPO, "npm", *rel.split("/"))


def package_version():
    with open(PACKAGE_JSON, encoding="utf-8") as fh:
        return json.load(fh)["version"]


def node_major():
    proc = subprocess.run([NODE, "--version"], stdout=subprocess.PIPE, timeout=TIMEOUT)
    match = re.match(rb"v(\d+)", proc.stdout)
    return int(match.group(1)) if match else 0


# A stand-in for the real module: importable with no side effects, and as
# `python -m tc_mcp` it reports SIGTERM and exits with a recognisable code.
FAKE_TC_MCP = r'''
import os, signal, sys, time

def on_term(signum, frame):
    sys.stdout.write("got SIGTERM\n")
    sys.stdout.flush()
    sys.exit(3)

if __name__ == "__main__":
    if sys.argv[1:] == ["--exit", "7"]:
        sys.exit(7)
    signal.signal(signal.SIGTERM, on_term)
    sys.stdout.write("ready " + " ".join(sys.argv[1:]) + "\n")
    sys.stdout.flush()
    time.sleep(30)
    sys.exit(0)
'''


@unittest.skipIf(NODE is None, "node is not installed")
class LauncherTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        if node_major() < 18:
            raise unittest.SkipTest("the launcher needs Node.js 18+ (20 recommended)")
        cls.launcher = launcher_path()

    def setUp(self):
        self._tmp = tempfile.mkdtemp(prefix="tc-npm-")
        self.tmp = os.path.realpath(self._tmp)
        self.addCleanup(shutil.rmtree, self._tmp, True)

    def empty_dir(self, name):
        path = os.path.join(self.tmp, name)
        os.makedirs(path)
        return path

    def env_without_python(self, **extra):
        """PATH holds only an empty directory; node is started by absolute path."""
        env = clean_env({"PYTHONPATH": None, "TC_PYTHON": None})
        env["PATH"] = self.empty_dir("empty-bin")
        env.update(extra)
        return env

    def run_launcher(self, args, env, input=None, timeout=TIMEOUT):
        return subprocess.run([NODE, self.launcher, *args], env=env, cwd=self.tmp,
                              input=input, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              timeout=timeout)

    def fake_module_dir(self):
        path = self.empty_dir("fake")
        with open(os.path.join(path, "tc_mcp.py"), "w", encoding="utf-8") as fh:
            fh.write(FAKE_TC_MCP)
        return path

    # -- no Python needed ----------------------------------------------------

    def test_version_needs_no_python(self):
        env = self.env_without_python(TC_PYTHON=os.path.join(self.tmp, "missing-python"))
        proc = self.run_launcher(["--version"], env)
        self.assertEqual(proc.returncode, 0, proc.stderr)
        self.assertEqual(proc.stdout.decode().strip(), "task-checkpoint-mcp " + package_version())
        self.assertEqual(proc.stderr, b"")

    def test_help_needs_no_python(self):
        env = self.env_without_python(TC_PYTHON=os.path.join(self.tmp, "missing-python"))
        for flag in ("--help", "-h"):
            proc = self.run_launcher([flag], env)
            self.assertEqual(proc.returncode, 0, proc.stderr)
            text = proc.stdout.decode()
            self.assertIn("pipx install task-checkpoint-mcp", text)
            self.assertIn("TC_PYTHON", text)
            self.assertIn("python -m tc_mcp", text)

    # -- no suitable Python ----------------------------------------------------

    def test_no_python_prints_install_command(self):
        env = self.env_without_python(TC_PYTHON=os.path.join(self.tmp, "no-such-python"))
        proc = self.run_launcher([], env, input=b"")
        err = proc.stderr.decode()
        self.assertEqual(proc.returncode, 1, err)
        self.assertIn("pipx install task-checkpoint-mcp", err)
        self.assertIn("TC_PYTHON", err)
        self.assertIsNone(STACK_LINE.search(err), "stack trace on stderr:\n" + err)
        self.assertNotIn("node:internal", err)
        self.assertEqual(proc.stdout, b"", "stdout belongs to MCP frames")

    def test_python_without_the_package_is_rejected(self):
        probe = subprocess.run([sys.executable, "-c", "import tc_mcp"], env=clean_env(
            {"PYTHONPATH": None}), cwd=self.tmp, stdout=subprocess.PIPE,
            stderr=subprocess.PIPE, timeout=TIMEOUT)
        if probe.returncode == 0:
            self.skipTest("tc_mcp is installed into this interpreter")
        env = self.env_without_python(TC_PYTHON=sys.executable)
        proc = self.run_launcher([], env, input=b"")
        err = proc.stderr.decode()
        self.assertEqual(proc.returncode, 1, err)
        self.assertIn("cannot import tc_mcp", err)
        self.assertIn("pipx install task-checkpoint-mcp", err)
        self.assertIsNone(STACK_LINE.search(err), err)

    # -- through to the real server -------------------------------------------

    def test_initialize_round_trip_against_the_checkout(self):
        env = clean_env({"PYTHONPATH": SCRIPTS, "TC_PYTHON": sys.executable})
        messages = [
            {"jsonrpc": "2.0", "id": 1, "method": "initialize",
             "params": {"protocolVersion": "2025-06-18", "capabilities": {},
                        "clientInfo": {"name": "npm-test", "version": "0"}}},
            {"jsonrpc": "2.0", "method": "notifications/initialized"},
            {"jsonrpc": "2.0", "id": 2, "method": "ping"},
            {"jsonrpc": "2.0", "id": 3, "method": "tools/list"},
        ]
        data = "".join(json.dumps(m) + "\n" for m in messages).encode("utf-8")
        proc = self.run_launcher([], env, input=data)
        self.assertEqual(proc.returncode, 0, proc.stderr)
        replies = [json.loads(line) for line in proc.stdout.decode("utf-8").splitlines()]
        self.assertEqual([r.get("id") for r in replies], [1, 2, 3], proc.stdout)
        info = replies[0]["result"]["serverInfo"]
        self.assertEqual(info["name"], "task-checkpoint-mcp")
        self.assertEqual(info["version"], package_version())
        self.assertEqual(replies[0]["result"]["protocolVersion"], "2025-06-18")
        self.assertEqual(replies[1]["result"], {})
        names = {tool["name"] for tool in replies[2]["result"]["tools"]}
        self.assertIn("tc_init", names)
        self.assertIn("tc_resume", names)

    def test_a_project_s_own_modules_are_not_imported(self):
        # The launcher runs from the client's working directory, usually the
        # user's project; its json.py must not replace the standard library's.
        for name in ("json", "secrets", "tempfile", "hashlib"):
            with open(os.path.join(self.tmp, name + ".py"), "w", encoding="utf-8") as fh:
                fh.write("raise SystemExit('the project\\'s %s.py was imported')\n" % name)
        env = clean_env({"PYTHONPATH": SCRIPTS, "TC_PYTHON": sys.executable})
        message = {"jsonrpc": "2.0", "id": 1, "method": "initialize",
                   "params": {"protocolVersion": "2025-06-18", "capabilities": {},
                              "clientInfo": {"name": "npm-test", "version": "0"}}}
        proc = self.run_launcher([], env, input=(json.dumps(message) + "\n").encode())
        self.assertEqual(proc.returncode, 0, proc.stderr)
        self.assertNotIn(b"was imported", proc.stderr)
        self.assertEqual(json.loads(proc.stdout.decode().splitlines()[0])["id"], 1)

    def test_arguments_reach_the_server(self):
        env = clean_env({"PYTHONPATH": SCRIPTS, "TC_PYTHON": sys.executable})
        proc = self.run_launcher(["--skill-path"], env)
        self.assertEqual(proc.returncode, 0, proc.stderr)
        self.assertEqual(os.path.realpath(proc.stdout.decode().strip()),
                         os.path.realpath(os.path.join(REPO, "SKILL.md")))

    @unittest.skipIf(os.name == "nt", "needs a python3 symlink on PATH")
    def test_python3_found_on_path(self):
        bindir = self.empty_dir("bin")
        os.symlink(sys.executable, os.path.join(bindir, "python3"))
        env = clean_env({"PYTHONPATH": self.fake_module_dir(),
                         "TC_PYTHON": os.path.join(self.tmp, "no-such-python")})
        env["PATH"] = bindir
        proc = self.run_launcher(["--exit", "7"], env)
        self.assertEqual(proc.returncode, 7, proc.stderr)
        self.assertIn("ignoring TC_PYTHON", proc.stderr.decode())

    def tc_mcp_command(self, folder, text):
        """An environment whose PATH is only a new folder holding a tc-mcp
        command with text (a #! script), and no Python that imports tc_mcp."""
        bindir = self.empty_dir(folder)
        script = os.path.join(bindir, "tc-mcp")
        with open(script, "w", encoding="utf-8") as fh:
            fh.write(text)
        os.chmod(script, 0o755)
        env = clean_env({"PYTHONPATH": None, "TC_PYTHON": None})
        env["PATH"] = bindir
        return env

    @unittest.skipIf(os.name == "nt", "needs a #! script to run as a command on PATH "
                                      "(Windows runs only .exe, .cmd and the like)")
    def test_a_pipx_install_is_found_through_its_command(self):
        # pipx gives the package a Python of its own: no python3 on PATH can
        # import tc_mcp, but its tc-mcp command is on PATH.
        env = self.tc_mcp_command("pipx-bin", "#!%s -S\nimport sys\nsys.path.insert(0, %r)\n"
                                  "from tc_mcp import main\nsys.exit(main())\n"
                                  % (sys.executable, SCRIPTS))
        proc = self.run_launcher(["--skill-path"], env)
        self.assertEqual(proc.returncode, 0, proc.stderr)
        self.assertEqual(os.path.realpath(proc.stdout.decode().strip()),
                         os.path.realpath(os.path.join(REPO, "SKILL.md")))
        message = {"jsonrpc": "2.0", "id": 1, "method": "initialize",
                   "params": {"protocolVersion": "2025-06-18", "capabilities": {},
                              "clientInfo": {"name": "npm-test", "version": "0"}}}
        proc = self.run_launcher([], env, input=(json.dumps(message) + "\n").encode())
        self.assertEqual(proc.returncode, 0, proc.stderr)
        reply = json.loads(proc.stdout.decode().splitlines()[0])
        self.assertEqual(reply["result"]["serverInfo"]["name"], "task-checkpoint-mcp")

    @unittest.skipIf(os.name == "nt", "needs a #! script to run as a command on PATH "
                                      "(Windows runs only .exe, .cmd and the like)")
    def test_a_command_of_that_name_that_is_not_the_server_is_passed_over(self):
        env = self.tc_mcp_command("other-bin", "#!/bin/sh\necho something else 1.0\n")
        proc = self.run_launcher([], env, input=b"")
        err = proc.stderr.decode()
        self.assertEqual(proc.returncode, 1, err)
        self.assertIn("tc-mcp on PATH: did not answer --version as task-checkpoint-mcp", err)
        self.assertEqual(proc.stdout, b"")

    def test_exit_code_is_forwarded(self):
        env = clean_env({"PYTHONPATH": self.fake_module_dir(), "TC_PYTHON": sys.executable})
        proc = self.run_launcher(["--exit", "7"], env)
        self.assertEqual(proc.returncode, 7, proc.stderr)

    @unittest.skipIf(os.name == "nt", "POSIX signals")
    def test_sigterm_is_forwarded(self):
        env = clean_env({"PYTHONPATH": self.fake_module_dir(), "TC_PYTHON": sys.executable})
        # Its own process group, so a child left behind by a broken launcher
        # can be cleaned up together with it.
        proc = subprocess.Popen([NODE, self.launcher, "serve", "--flag"], env=env, cwd=self.tmp,
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, start_new_session=True)
        try:
            first = proc.stdout.readline()
            self.assertEqual(first, b"ready serve --flag\n")
            proc.send_signal(signal.SIGTERM)
            try:
                rest, err = proc.communicate(timeout=20)
            except subprocess.TimeoutExpired:
                self.fail("the server did not end after SIGTERM reached the launcher")
        finally:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except OSError:
                pass
            proc.communicate()
        self.assertEqual(rest, b"got SIGTERM\n", err)
        self.assertEqual(proc.returncode, 3, err)

if __name__ == "__main__":
    unittest.main()
