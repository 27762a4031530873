"""Packaging: one version everywhere, the metadata registries read, and a real
sdist -> wheel -> install -> run cycle of the built distribution.

The build runs offline: the PEP 517 hooks of an interpreter that already has
setuptools (and `wheel`, or a setuptools new enough to build wheels by itself)
are called directly, in a copy of the checkout so the work tree stays clean.
The wheel is installed with pip into a fresh virtual environment, from the
file alone (--no-index --no-deps). When no such interpreter or pip can be
found the build tests are skipped and the reason says what is missing.
"""

import atexit
import email.parser
import json
import os
import re
import shutil
import stat
import subprocess
import sys
import tarfile
import tempfile
import unittest
import zipfile

import support
from support import REPO, SCRIPTS, SERVER, Server, clean_env

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    tomllib = None

PROJECT = "task-checkpoint-mcp"
SERVER_NAME = "io.github.task-checkpoint-mcp/task-checkpoint-mcp"
SCHEMA_URL = re.compile(
    r"^https://static\.modelcontextprotocol\.io/schemas/\d{4}-\d{2}-\d{2}/server\.schema\.json$")
ENTRY_POINTS = {"tc-mcp": "tc_mcp:main", "task-checkpoint-mcp": "tc_mcp:main"}
ALL_TOOLS = {"tc_init", "tc_switch", "tc_save", "tc_capture", "tc_show", "tc_restore",
             "tc_resume", "tc_export", "tc_import", "tc_compress"}
DOCUMENTED_ENV = {"TC_STORE", "TC_WATCH", "TC_WATCH_INTERVAL", "TC_DRIFT_MAX_WAIT",
                  "TC_GIT", "TC_GIT_VERIFY", "TC_SHA_REUSE"}
TIMEOUT = 60


def repo_path(rel):
    return os.path.join(REPO, *rel.split("/"))


def read_bytes(rel):
    with open(repo_path(rel), "rb") as fh:
        return fh.read()


def read_text(rel):
    return read_bytes(rel).decode("utf-8")


def load_json(rel):
    with open(repo_path(rel), encoding="utf-8") as fh:
        return json.load(fh)


def load_pyproject():
    with open(repo_path("pyproject.toml"), "rb") as fh:
        return tomllib.load(fh)


def pyproject_version_by_hand():
    """`version` of the [project] table, read without a TOML parser (3.10)."""
    section = None
    for line in read_text("pyproject.toml").splitlines():
        line = line.strip()
        if line.startswith("["):
            section = line.strip("[] ")
        elif section == "project":
            match = re.match(r'^version\s*=\s*"([^"]*)"\s*(#.*)?$', line)
            if match:
                return match.group(1)
    return None


def normalize_newlines(data):
    return data.replace(b"\r\n", b"\n")


def run(cmd, *, env=None, cwd=None, timeout=TIMEOUT, input=None):
    """Run a command; stdout and stderr come back as text."""
    return subprocess.run(cmd, env=env or clean_env({"PYTHONPATH": None}),
                          cwd=cwd or tempfile.gettempdir(), input=input,
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                          timeout=timeout, encoding="utf-8", errors="replace")


def checkout_env():
    return clean_env({"PYTHONPATH": SCRIPTS})


def stdio_session(cmd, messages, *, env=None, cwd=None):
    """Send newline-delimited JSON-RPC messages, close stdin, return {id: reply}."""
    data = "".join(json.dumps(m) + "\n" for m in messages)
    proc = run(cmd, env=env, cwd=cwd, input=data)
    replies = {}
    for line in proc.stdout.splitlines():
        if line.strip():
            msg = json.loads(line)
            replies[msg.get("id")] = msg
    return proc, replies


def initialize_messages(extra=()):
    return [
        {"jsonrpc": "2.0", "id": 1, "method": "initialize",
         "params": {"protocolVersion": "2025-06-18", "capabilities": {},
                    "clientInfo": {"name": "packaging-test", "version": "0"}}},
        {"jsonrpc": "2.0", "method": "notifications/initialized"},
        *extra,
    ]


def skill_front_matter(text):
    """The `key: value` lines between the opening and closing `---`."""
    lines = text.replace("\r\n", "\n").split("\n")
    if not lines or lines[0].strip() != "---":
        return None
    fields = {}
    for line in lines[1:]:
        if line.strip() == "---":
            return fields
        match = re.match(r"^([A-Za-z_][\w-]*)\s*:\s*(.*)$", line)
        if match:
            fields[match.group(1)] = match.group(2).strip().strip("'\"")
    return None


class VersionTest(unittest.TestCase):
    """Every place that states the version states the same one."""

    def test_all_versions_agree(self):
        versions = {}
        if tomllib is not None:
            versions["pyproject.toml [project].version"] = load_pyproject()["project"]["version"]
        versions["pyproject.toml (by hand)"] = pyproject_version_by_hand()
        server_json = load_json("server.json")
        versions["server.json version"] = server_json["version"]
        for i, package in enumerate(server_json["packages"]):
            versions["server.json packages[%d].version" % i] = package["version"]
        versions["npm/package.json version"] = load_json("npm/package.json")["version"]

        proc = run([sys.executable, SERVER, "--version"])
        self.assertEqual(proc.returncode, 0, proc.stderr)
        line = proc.stdout.strip()
        self.assertRegex(line, r"^%s \S+$" % re.escape(PROJECT))
        versions["tc_mcp.py --version"] = line.split()[-1]

        proc = run([sys.executable, "-c", "import tc; print(tc.__version__)"], env=checkout_env())
        self.assertEqual(proc.returncode, 0, proc.stderr)
        versions["tc.__version__"] = proc.stdout.strip()

        srv = Server()
        try:
            reply = srv.initialize()
        finally:
            srv.close()
        versions["initialize serverInfo.version"] = reply["result"]["serverInfo"]["version"]

        self.assertEqual(len(set(versions.values())), 1,
                         "versions disagree:\n" + "\n".join(
                             "  %s: %r" % item for item in sorted(versions.items())))
        self.assertRegex(versions["server.json version"], r"^\d+\.\d+\.\d+$")


class MetadataTest(unittest.TestCase):
    """The files the package indexes and registries read, checked statically."""

    @unittest.skipIf(tomllib is None, "tomllib is Python 3.11+; the wheel test checks "
                                      "the built metadata on 3.10")
    def test_pyproject(self):
        data = load_pyproject()
        project = data["project"]
        self.assertEqual(project["name"], PROJECT)
        self.assertEqual(project["requires-python"], ">=3.10")
        self.assertEqual(project.get("dependencies", []), [])
        self.assertFalse(project.get("optional-dependencies"),
                         "the package must not declare optional dependencies")
        self.assertNotIn("dependencies", project.get("dynamic", []))
        self.assertEqual(project["scripts"], ENTRY_POINTS)
        self.assertEqual(project["readme"], "README.md")

        build = data["build-system"]
        self.assertEqual(build["build-backend"], "setuptools.build_meta")
        for requirement in build["requires"]:
            self.assertRegex(requirement, r"^setuptools\b",
                             "setuptools is the only build requirement")

        setuptools_cfg = data["tool"]["setuptools"]
        self.assertEqual(setuptools_cfg["package-dir"], {"": "scripts"})
        self.assertEqual(sorted(setuptools_cfg["py-modules"]), ["tc", "tc_mcp"])
        self.assertNotIn("packages", setuptools_cfg)
        self.assertEqual(setuptools_cfg["data-files"],
                         {"share/task-checkpoint-mcp": ["SKILL.md"]})

    def test_entry_point_target_is_callable(self):
        proc = run([sys.executable, "-c",
                    "import tc_mcp; assert callable(tc_mcp.main); "
                    "assert callable(tc_mcp.skill_path); print(tc_mcp.__file__)"],
                   env=checkout_env())
        self.assertEqual(proc.returncode, 0, proc.stderr)
        self.assertEqual(os.path.realpath(proc.stdout.strip()),
                         os.path.realpath(os.path.join(SCRIPTS, "tc_mcp.py")))

    def test_python_dash_m_from_checkout(self):
        proc = run([sys.executable, "-m", "tc_mcp", "--version"], env=checkout_env())
        self.assertEqual(proc.returncode, 0, proc.stderr)
        self.assertEqual(proc.stdout.strip().split()[0], PROJECT)

    def test_python_dash_m_ignores_modules_in_the_working_directory(self):
        # The npm launcher runs `python -m tc_mcp` from the client's working
        # directory, usually the user's project; its own secrets.py or json.py
        # must not be imported in place of the standard library's.
        project = tempfile.mkdtemp(prefix="tc-shadow-")
        self.addCleanup(shutil.rmtree, project, True)
        for name in ("json", "secrets", "subprocess", "tempfile", "hashlib", "traceback"):
            with open(os.path.join(project, name + ".py"), "w") as fh:
                fh.write("raise SystemExit('the project\\'s %s.py was imported')\n" % name)
        with open(os.path.join(project, "app.txt"), "w") as fh:
            fh.write("work\n")
        srv = Server(env=dict(checkout_env(), TC_GIT="on"), cwd=project,
                     command=[sys.executable, "-m", "tc_mcp"])
        self.addCleanup(srv.close)
        srv.initialize()
        srv.ok("tc_init", root=project, name="shadowed")
        self.assertEqual(srv.ok("tc_save", root=project, title="one")["index"], 1)
        srv.close()
        self.assertNotIn("was imported", srv.stderr)

    @unittest.skipIf(os.name == "nt", "Windows does not let a process remove its own "
                                      "working directory")
    def test_python_dash_m_in_a_deleted_working_directory(self):
        gone = tempfile.mkdtemp(prefix="tc-gone-")
        messages = [{"jsonrpc": "2.0", "id": 1, "method": "initialize",
                     "params": {"protocolVersion": "2025-06-18", "capabilities": {},
                                "clientInfo": {"name": "t", "version": "0"}}}]
        code = ("import os, subprocess, sys; os.chdir(%r); os.rmdir(%r); "
                "sys.exit(subprocess.run([sys.executable, '-m', 'tc_mcp'], input=sys.stdin.read(),"
                " text=True).returncode)" % (gone, gone))
        proc = run([sys.executable, "-c", code], env=checkout_env(),
                   input="".join(json.dumps(m) + "\n" for m in messages))
        self.assertEqual(proc.returncode, 0, proc.stderr)
        self.assertEqual(json.loads(proc.stdout.splitlines()[0])["id"], 1, proc.stdout)

    def test_server_json(self):
        data = load_json("server.json")
        self.assertRegex(data["$schema"], SCHEMA_URL)
        self.assertEqual(data["name"], SERVER_NAME)
        self.assertRegex(data["name"], r"^[a-zA-Z0-9.-]+/[a-zA-Z0-9._-]+$")
        self.assertTrue(1 <= len(data["description"]) <= 100,
                        "the registry caps description at 100 characters")
        self.assertEqual(len(data["packages"]), 1)
        package = data["packages"][0]
        self.assertEqual(package["registryType"], "pypi")
        self.assertEqual(package["identifier"], PROJECT)
        self.assertEqual(package["transport"], {"type": "stdio"})
        self.assertEqual(package.get("registryBaseUrl", "https://pypi.org"), "https://pypi.org")
        self.assertNotIn("remotes", data)
        for variable in package.get("environmentVariables", []):
            self.assertIn(variable["name"], DOCUMENTED_ENV)
            self.assertFalse(variable.get("isRequired", False),
                             "%s has a default; it must not be required" % variable["name"])

    def test_registry_ownership_markers(self):
        # The MCP registry checks `mcp-name: <name>` in the PyPI description
        # (the README) and `mcpName` in an npm package.json.
        self.assertTrue("mcp-name: " + SERVER_NAME in read_text("README.md"),
                        "README.md needs the registry ownership marker, e.g. "
                        "<!-- mcp-name: %s -->" % SERVER_NAME)
        self.assertEqual(load_json("npm/package.json").get("mcpName"), SERVER_NAME)

    def test_glama_json(self):
        data = load_json("glama.json")
        self.assertEqual(data["$schema"], "https://glama.ai/mcp/schemas/server.json")
        self.assertIsInstance(data["maintainers"], list)
        self.assertTrue(data["maintainers"])
        for name in data["maintainers"]:
            self.assertRegex(name, r"^[A-Za-z0-9](?:[A-Za-z0-9-]*[A-Za-z0-9])?$")

    def test_npm_package_json(self):
        data = load_json("npm/package.json")
        self.assertEqual(data["name"], PROJECT)
        self.assertEqual(data.get("license"), "MIT")
        for key in ("dependencies", "devDependencies", "peerDependencies",
                    "optionalDependencies", "scripts"):
            self.assertFalse(data.get(key), "the launcher must have no %s" % key)
        self.assertEqual(list(data["bin"]), [PROJECT])
        launcher = os.path.join(REPO, "npm", *data["bin"][PROJECT].split("/"))
        self.assertTrue(os.path.isfile(launcher), launcher)
        with open(launcher, "rb") as fh:
            self.assertEqual(fh.readline().strip(), b"#!/usr/bin/env node")
        if os.name == "posix":
            self.assertTrue(os.access(launcher, os.X_OK), "launcher is not executable")
        self.assertEqual(read_bytes("npm/LICENSE"), read_bytes("LICENSE"))
        self.assertTrue(read_text("npm/README.md").strip())

    def test_license_is_mit(self):
        text = read_text("LICENSE")
        self.assertTrue(text.startswith("MIT License"))
        self.assertIn("Copyright (c) 2026 task-checkpoint-mcp contributors", text)
        self.assertIn("THE SOFTWARE IS PROVIDED \"AS IS\"", text)

    def test_skill_front_matter(self):
        fields = skill_front_matter(read_text("SKILL.md"))
        self.assertIsNotNone(fields, "SKILL.md must open with a --- front matter block")
        self.assertRegex(fields.get("name", ""), r"^[a-z0-9]+(-[a-z0-9]+)*$")
        self.assertLessEqual(len(fields["name"]), 64)
        self.assertTrue(fields.get("description"), "front matter needs a description")
        self.assertLessEqual(len(fields["description"]), 1024)

    def test_manifest_in(self):
        included = set()
        for line in read_text("MANIFEST.in").splitlines():
            words = line.split()
            if not words or words[0].startswith("#"):
                continue
            if words[0] == "include":
                included.update(words[1:])
            elif words[0] in ("graft", "recursive-include"):
                included.add(words[1] + "/")
        for name in ("README.md", "SKILL.md", "LICENSE"):
            self.assertIn(name, included)
        self.assertTrue("scripts/" in included
                        or {"scripts/tc.py", "scripts/tc_mcp.py"} <= included, included)

    def test_checkout_finds_its_skill(self):
        proc = run([sys.executable, SERVER, "--skill-path"])
        self.assertEqual(proc.returncode, 0, proc.stderr)
        self.assertEqual(os.path.realpath(proc.stdout.strip()),
                         os.path.realpath(repo_path("SKILL.md")))
        proc = subprocess.run([sys.executable, SERVER, "--print-skill"], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, env=clean_env(), timeout=TIMEOUT)
        self.assertEqual(proc.returncode, 0, proc.stderr)
        self.assertEqual(normalize_newlines(proc.stdout), normalize_newlines(read_bytes("SKILL.md")))

    def test_ci_files(self):
        ci_run = repo_path(".ci/run")
        self.assertIn('python3 -m unittest discover -s tests -p "test_*.py" -v',
                      read_text(".ci/run"))
        if os.name == "posix":
            self.assertTrue(os.access(ci_run, os.X_OK), ".ci/run is not executable")
        workflow = read_text(".github/workflows/ci.yml")
        self.assertIn('-m unittest discover -s tests -p "test_*.py" -v', workflow)
        for runner in ("ubuntu-latest", "windows-latest", "macos-latest"):
            self.assertIn(runner, workflow)


# --- the real build -------------------------------------------------------

BUILD_PROBE = r"""
import json, sys
info = {"executable": sys.executable, "setuptools": None, "wheel": False}
try:
    import setuptools
    info["setuptools"] = setuptools.__version__
except Exception:
    pass
try:
    import wheel
    info["wheel"] = True
except Exception:
    pass
print(json.dumps(info))
"""

HOOK = ("import sys, setuptools.build_meta as backend; "
        "name = getattr(backend, sys.argv[1])(sys.argv[2]); "
        "print('BUILT:' + name)")

COPY_IGNORE = shutil.ignore_patterns(
    ".git", "__pycache__", "*.pyc", ".checkpoints", ".task-checkpoint-store.json",
    "build", "dist", "*.egg-info", "node_modules", ".venv", "venv")


def version_tuple(text):
    parts = []
    for piece in text.split(".")[:2]:
        match = re.match(r"\d+", piece)
        parts.append(int(match.group()) if match else 0)
    return tuple(parts)


def find_build_python():
    """An interpreter whose setuptools can build sdists and wheels offline.

    Returns (executable, None) or (None, reason).
    """
    candidates = [sys.executable, shutil.which("python3"), shutil.which("python")]
    if os.name == "posix":
        candidates.append("/usr/bin/python3")
    seen, findings = set(), []
    for candidate in candidates:
        if not candidate or not os.path.exists(candidate):
            continue
        try:
            proc = run([candidate, "-c", BUILD_PROBE], timeout=30)
            info = json.loads(proc.stdout.strip().splitlines()[-1])
        except (OSError, ValueError, IndexError, subprocess.TimeoutExpired):
            continue
        if info["executable"] in seen:
            continue
        seen.add(info["executable"])
        tools = info["setuptools"]
        if tools is None:
            findings.append("%s: no setuptools" % info["executable"])
        elif version_tuple(tools) < (61, 0):
            findings.append("%s: setuptools %s < 61" % (info["executable"], tools))
        elif not info["wheel"] and version_tuple(tools) < (70, 1):
            findings.append("%s: setuptools %s without the wheel package"
                            % (info["executable"], tools))
        else:
            return info["executable"], None
    return None, ("no interpreter can build the wheel offline (needs setuptools>=61 with "
                  "`wheel`, or setuptools>=70.1): " + "; ".join(findings or ["none found"]))


def pip_supports_python_option():
    """True when this interpreter's pip can install into another one (pip>=22.3)."""
    proc = run([sys.executable, "-m", "pip", "--version"], timeout=30)
    match = re.match(r"pip (\d+)\.(\d+)", proc.stdout)
    return proc.returncode == 0 and match and (int(match[1]), int(match[2])) >= (22, 3)


def venv_paths(venv):
    bindir = os.path.join(venv, "Scripts" if os.name == "nt" else "bin")
    exe = ".exe" if os.name == "nt" else ""
    return bindir, os.path.join(bindir, "python" + exe), exe


class DistributionBuild:
    """Build sdist, build the wheel from the unpacked sdist, install it into
    a virtual environment, all in a new temporary folder (cls.tmp)."""

    @classmethod
    def prepare(cls):
        build_python, reason = find_build_python()
        if build_python is None:
            raise unittest.SkipTest(reason)
        cls._tmp = tempfile.mkdtemp(prefix="tc-packaging-")
        cls.tmp = os.path.realpath(cls._tmp)
        try:
            cls.build(build_python)
            cls.install()
        except BaseException:
            shutil.rmtree(cls._tmp, ignore_errors=True)
            raise

    @classmethod
    def call_hook(cls, build_python, hook, source, outdir):
        env = clean_env({"PYTHONPATH": None, "PYTHONDONTWRITEBYTECODE": "1",
                         "SETUPTOOLS_USE_DISTUTILS": None})
        proc = run([build_python, "-c", HOOK, hook, outdir], env=env, cwd=source, timeout=120)
        built = [line[len("BUILT:"):] for line in proc.stdout.splitlines()
                 if line.startswith("BUILT:")]
        if proc.returncode != 0 or not built:
            raise AssertionError("%s failed (exit %s):\n%s\n%s" % (
                hook, proc.returncode, proc.stdout[-4000:], proc.stderr[-4000:]))
        return os.path.join(outdir, built[-1])

    @classmethod
    def build(cls, build_python):
        source = os.path.join(cls.tmp, "checkout")
        shutil.copytree(REPO, source, ignore=COPY_IGNORE)
        dist = os.path.join(cls.tmp, "dist")
        os.makedirs(dist)
        cls.sdist = cls.call_hook(build_python, "build_sdist", source, dist)
        unpacked = os.path.join(cls.tmp, "unpacked")
        with tarfile.open(cls.sdist) as tar:
            cls.sdist_names = sorted(tar.getnames())
            for member in tar.getmembers():
                if member.name.startswith(("/", "..")) or ".." in member.name.split("/"):
                    raise AssertionError("unsafe path in sdist: %r" % member.name)
            if hasattr(tarfile, "data_filter"):
                tar.extractall(unpacked, filter="data")
            else:
                tar.extractall(unpacked)
        roots = os.listdir(unpacked)
        if len(roots) != 1:
            raise AssertionError("sdist must have one top directory, has %r" % roots)
        cls.sdist_root = roots[0]
        cls.wheel = cls.call_hook(build_python, "build_wheel",
                                  os.path.join(unpacked, roots[0]), dist)

    @classmethod
    def install(cls):
        cls.venv = os.path.join(cls.tmp, "venv")
        pip_flags = ["install", "--no-deps", "--no-index", "--no-cache-dir",
                     "--disable-pip-version-check", "--no-input", cls.wheel]
        bindir, python, _ = venv_paths(cls.venv)
        if pip_supports_python_option():
            proc = run([sys.executable, "-m", "venv", "--without-pip", cls.venv], timeout=120)
            if proc.returncode != 0:
                raise unittest.SkipTest("cannot create a virtual environment: " + proc.stderr)
            proc = run([sys.executable, "-m", "pip", "--python", python, *pip_flags], timeout=120)
        else:
            proc = run([sys.executable, "-m", "venv", cls.venv], timeout=180)
            if proc.returncode != 0:
                raise unittest.SkipTest("cannot create a virtual environment with pip: "
                                        + proc.stderr)
            proc = run([python, "-m", "pip", *pip_flags], timeout=120)
        if proc.returncode != 0:
            raise AssertionError("pip install of the wheel failed:\n%s\n%s"
                                 % (proc.stdout[-4000:], proc.stderr[-4000:]))


class BuiltDistributionTest(DistributionBuild, unittest.TestCase):
    """The built distribution: what it holds, and what it installs runs (the
    build the tests of the installed commands use too)."""

    @classmethod
    def setUpClass(cls):
        shared = SharedInstall.ready()
        for name in ("tmp", "venv", "sdist", "sdist_names", "sdist_root", "wheel"):
            setattr(cls, name, getattr(shared, name))

    def command(self, name):
        bindir, _, exe = venv_paths(self.venv)
        path = os.path.join(bindir, name + exe)
        self.assertTrue(os.path.isfile(path), "%s was not installed" % path)
        return path

    def installed_env(self):
        """No PYTHONPATH, no TC_*: only the venv can provide tc_mcp."""
        return clean_env({"PYTHONPATH": None})

    # -- what was built ----------------------------------------------------

    def test_sdist_contents(self):
        root = self.sdist_root
        # Newer setuptools normalises the name in the file and directory.
        self.assertIn(root, {"task-checkpoint-mcp-0.1.0", "task_checkpoint_mcp-0.1.0"})
        names = {name[len(root) + 1:] for name in self.sdist_names if name.startswith(root + "/")}
        for needed in ("README.md", "SKILL.md", "LICENSE", "MANIFEST.in", "pyproject.toml",
                       "PKG-INFO", "server.json", "glama.json",
                       "scripts/tc.py", "scripts/tc_mcp.py"):
            self.assertIn(needed, names)
        for name in names:
            self.assertFalse(name.startswith(("tests/", "tools/", "npm/", ".github/", ".ci/",
                                              ".git/")), "unexpected in the sdist: " + name)
            self.assertNotIn("__pycache__", name)

    def test_wheel_contents_and_metadata(self):
        with zipfile.ZipFile(self.wheel) as whl:
            names = whl.namelist()
            dist_info = [n for n in names if n.split("/")[0].endswith(".dist-info")]
            payload = sorted(n for n in names if n not in dist_info)
            data_dir = "task_checkpoint_mcp-0.1.0.data/data/share/task-checkpoint-mcp/"
            self.assertEqual(payload, sorted(["tc.py", "tc_mcp.py", data_dir + "SKILL.md"]))
            self.assertEqual(whl.read(data_dir + "SKILL.md"), read_bytes("SKILL.md"))
            self.assertEqual(whl.read("tc.py"), read_bytes("scripts/tc.py"))
            self.assertEqual(whl.read("tc_mcp.py"), read_bytes("scripts/tc_mcp.py"))
            prefix = dist_info[0].split("/")[0] + "/"
            metadata = email.parser.Parser().parsestr(
                whl.read(prefix + "METADATA").decode("utf-8"))
            entry_points = whl.read(prefix + "entry_points.txt").decode("utf-8")
            self.assertTrue(any(re.search(r"(^|/)LICEN[CS]E", n) for n in dist_info),
                            "LICENSE is not in the wheel")
        self.assertEqual(metadata["Name"], PROJECT)
        self.assertEqual(metadata["Version"], "0.1.0")
        self.assertEqual(metadata["Requires-Python"], ">=3.10")
        self.assertIsNone(metadata.get_all("Requires-Dist"), "no dependencies may be declared")
        self.assertTrue("mcp-name: " + SERVER_NAME in metadata.get_payload(),
                        "the long description (README.md) lacks the mcp-name marker")
        section, scripts = None, {}
        for line in entry_points.splitlines():
            line = line.strip()
            if line.startswith("["):
                section = line.strip("[]")
            elif "=" in line and section == "console_scripts":
                key, value = (part.strip() for part in line.split("=", 1))
                scripts[key] = value
        self.assertEqual(scripts, ENTRY_POINTS)

    # -- what was installed ------------------------------------------------

    def test_entry_points_report_the_version(self):
        for name in ENTRY_POINTS:
            proc = run([self.command(name), "--version"], env=self.installed_env())
            self.assertEqual(proc.returncode, 0, proc.stderr)
            self.assertEqual(proc.stdout.strip(), "%s 0.1.0" % PROJECT)
        _, python, _ = venv_paths(self.venv)
        proc = run([python, "-c", "import tc_mcp, tc; print(tc_mcp.__file__); print(tc.__file__)"],
                   env=self.installed_env())
        self.assertEqual(proc.returncode, 0, proc.stderr)
        for path in proc.stdout.split():
            self.assertTrue(os.path.realpath(path).startswith(self.tmp + os.sep),
                            "imported from outside the venv: " + path)
        proc = run([python, "-m", "tc_mcp", "--version"], env=self.installed_env())
        self.assertEqual(proc.stdout.strip(), "%s 0.1.0" % PROJECT, proc.stderr)

    def test_bundled_skill_is_found(self):
        expected = os.path.join(self.venv, "share", "task-checkpoint-mcp", "SKILL.md")
        with open(expected, "rb") as fh:
            self.assertEqual(fh.read(), read_bytes("SKILL.md"))
        proc = run([self.command("tc-mcp"), "--skill-path"], env=self.installed_env())
        self.assertEqual(proc.returncode, 0, proc.stderr)
        self.assertEqual(os.path.realpath(proc.stdout.strip()), os.path.realpath(expected))
        proc = subprocess.run([self.command("tc-mcp"), "--print-skill"], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, env=self.installed_env(),
                              cwd=self.tmp, timeout=TIMEOUT)
        self.assertEqual(proc.returncode, 0, proc.stderr)
        self.assertEqual(normalize_newlines(proc.stdout), normalize_newlines(read_bytes("SKILL.md")))

    def test_bundled_skill_is_found_after_an_install_into_a_folder(self):
        target = os.path.join(self.tmp, "target")
        proc = run([sys.executable, "-m", "pip", "install", "--target", target, "--no-deps",
                    "--no-index", "--no-cache-dir", "--disable-pip-version-check",
                    "--no-input", self.wheel], timeout=120)
        if proc.returncode != 0 and "No module named pip" in proc.stderr:
            self.skipTest("no pip for " + sys.executable)
        self.assertEqual(proc.returncode, 0, proc.stderr)
        expected = os.path.join(target, "share", "task-checkpoint-mcp", "SKILL.md")
        self.assertTrue(os.path.isfile(expected), os.listdir(target))
        proc = run([sys.executable, "-m", "tc_mcp", "--skill-path"],
                   env=clean_env({"PYTHONPATH": target}))
        self.assertEqual(proc.returncode, 0, proc.stderr)
        self.assertEqual(os.path.realpath(proc.stdout.strip()), os.path.realpath(expected))

    def test_installed_server_speaks_mcp(self):
        workspace = os.path.join(self.tmp, "ws-serve")
        support.write(workspace, "notes.txt", "first draft\n")
        proc, replies = stdio_session(
            [self.command("tc-mcp")],
            initialize_messages([
                {"jsonrpc": "2.0", "id": 2, "method": "tools/list"},
                {"jsonrpc": "2.0", "id": 3, "method": "tools/call",
                 "params": {"name": "tc_init", "arguments": {"root": workspace,
                                                              "name": "packaging check"}}},
                {"jsonrpc": "2.0", "id": 4, "method": "tools/call",
                 "params": {"name": "tc_save", "arguments": {"root": workspace,
                                                              "title": "first step",
                                                              "conclusion": "it installs",
                                                              "next": "nothing"}}},
            ]),
            env=self.installed_env(), cwd=self.tmp)
        self.assertEqual(proc.returncode, 0, proc.stderr)
        self.assertEqual(set(replies), {1, 2, 3, 4}, proc.stdout)
        info = replies[1]["result"]["serverInfo"]
        self.assertEqual((info["name"], info["version"]), (PROJECT, "0.1.0"))
        self.assertEqual({tool["name"] for tool in replies[2]["result"]["tools"]}, ALL_TOOLS)
        init = replies[3]["result"]
        self.assertFalse(init.get("isError"), init)
        task_id = init["structuredContent"]["task_id"]
        save = replies[4]["result"]
        self.assertFalse(save.get("isError"), save)
        self.assertEqual(save["structuredContent"]["index"], 1)
        step = os.path.join(workspace, ".checkpoints", "tasks", task_id, "steps", "s0001.json")
        with open(step, encoding="utf-8") as fh:
            self.assertEqual(json.load(fh)["title"], "first step")

    def test_install_skill_refuses_to_overwrite(self):
        target = os.path.join(self.tmp, "home", ".claude", "skills", "task-checkpoint")
        skill_file = os.path.join(target, "SKILL.md")
        tc_mcp = self.command("tc-mcp")
        proc = run([tc_mcp, "--install-skill", target], env=self.installed_env())
        self.assertEqual(proc.returncode, 0, proc.stderr)
        with open(skill_file, "rb") as fh:
            self.assertEqual(normalize_newlines(fh.read()), normalize_newlines(read_bytes("SKILL.md")))
        if os.name != "nt":  # readable by all, as cp would leave it (the umask is inherited)
            umask = os.umask(0o022)
            os.umask(umask)
            self.assertEqual(stat.S_IMODE(os.stat(skill_file).st_mode), 0o666 & ~umask)

        with open(skill_file, "wb") as fh:
            fh.write(b"my local edits\n")
        proc = run([tc_mcp, "--install-skill", target], env=self.installed_env())
        self.assertNotEqual(proc.returncode, 0, "a second install must refuse without --force")
        self.assertIn("--force", proc.stderr)
        self.assertNotIn("Traceback", proc.stderr)
        with open(skill_file, "rb") as fh:
            self.assertEqual(fh.read(), b"my local edits\n")

        proc = run([tc_mcp, "--install-skill", target, "--force"], env=self.installed_env())
        self.assertEqual(proc.returncode, 0, proc.stderr)
        with open(skill_file, "rb") as fh:
            self.assertEqual(normalize_newlines(fh.read()), normalize_newlines(read_bytes("SKILL.md")))
        self.assertEqual(os.listdir(target), ["SKILL.md"])


class SharedInstall(DistributionBuild):
    """One installed copy for the tests of the installed commands (the
    command line, the hooks), built at most once per test process."""

    built = False
    skip_reason = None

    @classmethod
    def ready(cls):
        """The class, built and installed (removed when the process exits);
        SkipTest where nothing can be built or installed here."""
        if cls.skip_reason:
            raise unittest.SkipTest(cls.skip_reason)
        if not cls.built:
            try:
                cls.prepare()
            except unittest.SkipTest as exc:
                cls.skip_reason = str(exc)
                raise
            atexit.register(shutil.rmtree, cls._tmp, True)
            cls.built = True
        return cls

    @classmethod
    def command(cls, name):
        """The path of the installed command name."""
        bindir, _, exe = venv_paths(cls.ready().venv)
        return os.path.join(bindir, name + exe)


if __name__ == "__main__":
    unittest.main()
