"""Client hooks: `tc-mcp hook session-start` and `tc-mcp hook capture` fed
the JSON objects Claude Code and Codex write to a hook's stdin.

A hook must never block or break its session: it always exits 0, quickly
(at most HOOK_SECONDS, also when the store lock is held), with at most one
line on stderr. session-start prints the handoff only when the workspace
has an open task; capture prints nothing and leaves a drift record labelled
with the event (and a shell tool's command) that restores.
"""

import fcntl
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import unittest

import support
from support import SERVER, Server, clean_env, read, write

import tc_mcp

HOOK = (sys.executable, "-S", SERVER, "hook")
LIMIT = 5.0  # seconds a hook may take, whatever happens


def claude_event(event, cwd, **fields):
    """What Claude Code writes to a command hook's stdin."""
    return dict({"session_id": "2f1c7a52-6d1e-4c1f-9a77-0d3c2b1e9f10",
                 "transcript_path": os.path.join(cwd, ".claude-transcript.jsonl"),
                 "cwd": cwd, "permission_mode": "default", "hook_event_name": event}, **fields)


def codex_event(event, cwd, **fields):
    """What Codex writes to a command hook's stdin."""
    return dict({"session_id": "019d036d-c7fa-72d2-b6fd-78878bfe34e4", "transcript_path": None,
                 "cwd": cwd, "hook_event_name": event, "model": "gpt-5-codex",
                 "permission_mode": "default"}, **fields)


def claude_bash(cwd, command):
    return claude_event("PreToolUse", cwd, tool_name="Bash", tool_use_id="toolu_01",
                        tool_input={"command": command, "description": "run it"})


def codex_bash(cwd, command):
    return codex_event("PreToolUse", cwd, tool_name="Bash", tool_use_id="call_01",
                       tool_input={"command": command})


class HookTest(unittest.TestCase):
    def setUp(self):
        self._tmp = tempfile.mkdtemp(prefix="tc-hooks-")
        self.addCleanup(shutil.rmtree, self._tmp, True)
        self.tmp = os.path.realpath(self._tmp)
        self.root = os.path.join(self.tmp, "ws")
        self.store = os.path.join(self.root, ".checkpoints")
        write(self.root, "db/schema.sql", "create table a (id int);\n")
        self.srv = Server()
        self.addCleanup(self.srv.close)
        self.srv.initialize()

    def start_task(self):
        self.srv.ok("tc_init", root=self.root, name="hooked task", goal="keep rollback points")
        self.srv.ok("tc_save", root=self.root, title="schema v1", conclusion="one table",
                    next="migrate")

    def hook(self, name, event=None, *, raw=None, stdin=None, command=HOOK, cwd=None,
             env=None):
        """Run a hook; (stdout, stderr) once it is checked to have exited 0
        in time with at most one line on stderr and no traceback."""
        data = raw if raw is not None else (None if event is None
                                            else json.dumps(event).encode("utf-8"))
        started = time.monotonic()
        proc = subprocess.run(list(command) + [name], input=data,
                              stdin=stdin if data is None else None,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              env=env or clean_env(), cwd=cwd or self.tmp, timeout=30)
        elapsed = time.monotonic() - started
        err = proc.stderr.decode("utf-8", "replace")
        self.assertEqual(proc.returncode, 0, err)
        self.assertLess(elapsed, LIMIT, err)
        self.assertNotIn("Traceback", err)
        self.assertLessEqual(len(err.splitlines()), 1, err)
        return proc.stdout.decode("utf-8"), err

    def drifts(self):
        return self.srv.ok("tc_show", root=self.root, include_drift=True, limit=200)["drifts"]


class SessionStartTest(HookTest):
    def test_an_open_task_gives_its_handoff_and_the_call_to_make(self):
        self.start_task()
        handoff = self.srv.ok("tc_resume", root=self.root)["handoff"]
        for event in (claude_event("SessionStart", self.root, source="startup"),
                      codex_event("SessionStart", self.root, source="resume")):
            out, err = self.hook("session-start", event)
            self.assertTrue(out.startswith(handoff + "\n\n"), out)
            self.assertIn("Current step: 1 (schema v1)", out)
            self.assertIn("call tc_resume (root %s)" % self.root, out.lower())
            self.assertEqual(err, "")
            self.assertFalse(out.lstrip().startswith(("{", "[")))  # Codex parses those as JSON

    def test_a_subfolder_is_the_workspace_above_it(self):
        self.start_task()
        out, _ = self.hook("session-start", claude_event("SessionStart",
                                                          os.path.join(self.root, "db")))
        self.assertIn("Task: hooked task", out)
        out, _ = self.hook("session-start", cwd=os.path.join(self.root, "db"),
                           stdin=subprocess.DEVNULL)
        self.assertIn("Task: hooked task", out)

    def test_nothing_is_printed_without_an_open_task(self):
        event = claude_event("SessionStart", self.root, source="startup")
        self.assertEqual(self.hook("session-start", event), ("", ""))
        self.assertFalse(os.path.exists(self.store))
        self.start_task()
        self.srv.ok("tc_save", root=self.root, title="done", close=True)
        self.assertEqual(self.hook("session-start", event), ("", ""))

    def test_garbage_and_no_stdin_still_exit_0(self):
        self.start_task()
        for raw in (b"not json at all", b"[1, 2]", b"\xff\xfe\x00", b'{"cwd": 3'):
            out, err = self.hook("session-start", raw=raw, cwd=self.root)
            self.assertIn("not a JSON object", err)
            self.assertIn("Task: hooked task", out)  # the current directory stands in
        out, err = self.hook("session-start", stdin=subprocess.DEVNULL, cwd=self.tmp)
        self.assertEqual((out, err), ("", ""))
        out, err = self.hook("bogus", stdin=subprocess.DEVNULL)
        self.assertIn("hook session-start", err)
        self.assertEqual(out, "")


class CaptureTest(HookTest):
    def test_a_pre_tool_use_capture_is_a_labelled_drift_record_that_restores(self):
        self.start_task()
        for maker in (claude_bash, codex_bash):
            with self.subTest(client=maker.__name__):
                before = ("create table a (id int);\nalter table a add b int; -- %s\n"
                          % maker.__name__).encode()
                write(self.root, "db/schema.sql", before)
                out, err = self.hook("capture", maker(self.root, "psql -f migrate.sql\n"
                                                                 "  && rm -rf db/old"))
                self.assertEqual((out, err), ("", ""))
                drift = self.drifts()[-1]
                self.assertEqual(drift["label"], "PreToolUse Bash: psql -f migrate.sql "
                                                 "&& rm -rf db/old")
                self.assertEqual(drift["modified"], ["db/schema.sql"])
                write(self.root, "db/schema.sql", "drop table a;\n")
                self.srv.ok("tc_restore", root=self.root, drift_id=drift["id"], apply=True)
                self.assertEqual(read(self.root, "db/schema.sql"), before)

    def test_compaction_and_stop_are_labelled_with_the_event(self):
        self.start_task()
        events = [claude_event("PreCompact", self.root, trigger="auto", custom_instructions=""),
                  codex_event("Stop", self.root, turn_id="t1", stop_hook_active=False),
                  claude_event("PostToolUse", self.root, tool_name="Write",
                               tool_input={"file_path": "x", "content": "y"})]
        for number, event in enumerate(events):
            write(self.root, "notes.txt", "round %d\n" % number)
            self.assertEqual(self.hook("capture", event), ("", ""))
        labels = [d.get("label") for d in self.drifts()[-3:]]
        self.assertEqual(labels, ["PreCompact", "Stop", "PostToolUse Write"])

    def test_a_long_command_is_cut_and_nothing_changed_records_nothing(self):
        self.start_task()
        write(self.root, "notes.txt", "changed\n")
        self.hook("capture", claude_bash(self.root, "echo " + "x" * 500))
        drift = self.drifts()[-1]
        self.assertEqual(len(drift["label"]), 200)
        self.assertTrue(drift["label"].startswith("PreToolUse Bash: echo xxx"))
        count = len(self.drifts())
        self.hook("capture", claude_bash(self.root, "ls"))
        self.assertEqual(len(self.drifts()), count)

    def test_garbage_no_stdin_and_no_task_exit_0(self):
        self.assertEqual(self.hook("capture", claude_bash(self.root, "ls")), ("", ""))
        self.assertFalse(os.path.exists(self.store))
        self.start_task()
        write(self.root, "notes.txt", "garbage round\n")
        out, err = self.hook("capture", raw=b"\x00garbage", cwd=self.root)
        self.assertIn("not a JSON object", err)
        self.assertEqual(self.drifts()[-1].get("label"), "hook")
        write(self.root, "notes.txt", "no stdin round\n")
        self.assertEqual(self.hook("capture", stdin=subprocess.DEVNULL,
                                   cwd=os.path.join(self.root, "db")), ("", ""))
        self.assertEqual(self.drifts()[-1]["modified"], ["notes.txt"])

    def test_a_held_store_lock_does_not_hold_the_hook(self):
        self.start_task()
        write(self.root, "notes.txt", "while the lock is held\n")
        fd = os.open(os.path.join(self.store, "state.lock"), os.O_RDWR)
        self.addCleanup(os.close, fd)
        fcntl.flock(fd, fcntl.LOCK_EX)
        timer = threading.Timer(15, fcntl.flock, (fd, fcntl.LOCK_UN))
        timer.start()
        self.addCleanup(timer.join)
        self.addCleanup(timer.cancel)
        started = time.monotonic()
        out, err = self.hook("capture", codex_bash(self.root, "make"))
        self.assertEqual(out, "")
        self.assertIn("locked by another process", err)
        self.assertLess(time.monotonic() - started, tc_mcp.HOOK_SECONDS,
                        "a busy store is given up on before the hook's own limit")
        fcntl.flock(fd, fcntl.LOCK_UN)
        self.srv.ok("tc_capture", root=self.root)  # the store reads correctly after it
        self.assertTrue(self.srv.ok("tc_resume", root=self.root)["health"]["ok"])

    def test_the_installed_entry_point_runs_the_hooks(self):
        import test_packaging
        command = test_packaging.SharedInstall.command("tc-mcp")
        self.start_task()
        write(self.root, "notes.txt", "installed\n")
        env = clean_env({"PYTHONPATH": None})
        self.hook("capture", claude_bash(self.root, "rm -rf build"), command=[command, "hook"],
                  env=env)
        self.assertEqual(self.drifts()[-1]["label"], "PreToolUse Bash: rm -rf build")
        out, _ = self.hook("session-start", codex_event("SessionStart", self.root,
                                                        source="startup"),
                           command=[command, "hook"], env=env)
        self.assertIn("Task: hooked task", out)


class ReadmeSnippetTest(unittest.TestCase):
    def test_the_readme_snippet_names_these_hooks(self):
        with open(os.path.join(support.REPO, "README.md"), encoding="utf-8") as fh:
            text = fh.read()
        section = text[text.index("### Client hooks"):]
        snippet = json.loads(section[section.index("```json") + 7:section.index("```\n", 8)])
        hooks = snippet["hooks"]
        self.assertEqual(set(hooks), {"SessionStart", "PreToolUse", "PreCompact", "Stop"})
        self.assertEqual([group.get("matcher") for group in hooks["PreToolUse"]], ["Bash"])
        for event, groups in hooks.items():
            for group in groups:
                for hook in group["hooks"]:
                    self.assertEqual(hook["type"], "command")
                    program, word, name = hook["command"].split()
                    self.assertEqual((program, word), ("tc-mcp", "hook"))
                    self.assertEqual(name, "session-start" if event == "SessionStart"
                                     else "capture")
                    self.assertIn(name, tc_mcp.HOOKS)
                    self.assertGreater(hook["timeout"], tc_mcp.HOOK_SECONDS)


class NothingWrittenOutsideTest(HookTest):
    def test_hooks_write_only_the_workspace_and_store(self):
        for folder in ("home", "tmp", "beside"):
            os.makedirs(os.path.join(self.tmp, folder))
        env = clean_env({"HOME": os.path.join(self.tmp, "home"),
                         "TMPDIR": os.path.join(self.tmp, "tmp")})
        self.start_task()
        before = [e for e in support.tree_listing(self.tmp) if not e[0].startswith("ws")]
        write(self.root, "notes.txt", "one\n")
        for name, event in (("session-start", claude_event("SessionStart", self.root,
                                                           source="startup")),
                            ("capture", claude_bash(self.root, "rm -rf build")),
                            ("capture", codex_event("Stop", self.root)),
                            ("session-start", codex_event("SessionStart", self.root,
                                                          source="compact"))):
            self.hook(name, event, env=env, cwd=os.path.join(self.tmp, "beside"))
        self.hook("capture", raw=b"garbage", env=env, cwd=os.path.join(self.tmp, "beside"))
        self.assertEqual([e for e in support.tree_listing(self.tmp)
                          if not e[0].startswith("ws")], before)
        self.assertEqual(self.drifts()[-1]["label"], "PreToolUse Bash: rm -rf build")


if __name__ == "__main__":
    unittest.main()
