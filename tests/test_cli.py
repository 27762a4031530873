"""The command line for people: `tc-mcp COMMAND` on a real store while a
server holds the same store, its text and --json output, its exit status,
and that what it does is what the server then sees.

Black-box: `python scripts/tc_mcp.py` (and once the installed entry point)
as a subprocess, the server from support.Server. The preview and diff
output waits for tc_restore's and tc_show's `diff`: those tests are
skipped, saying so, while the tools' schemas do not declare it.
"""

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import unittest

import support
from support import SERVER, Server, clean_env, read, write

import tc_mcp

CLI = (sys.executable, "-S", SERVER)
RESTORE_DIFF = "diff" in tc_mcp.TOOLS["tc_restore"].input["properties"]
SHOW_DIFF = "diff" in tc_mcp.TOOLS["tc_show"].input["properties"]
NO_RESTORE_DIFF = "tc_restore does not take diff yet (its schema lacks it)"
NO_SHOW_DIFF = "tc_show does not take diff yet (its schema lacks it)"
STEPS = [("first draft", "notes exist", "v1\n"),
         ("second draft", "the plan holds\nsecond line of the conclusion", "v2\n"),
         ("third draft", "ready for review", "v3\n")]


def run(argv, *, env=None, cwd=None, input=None, timeout=60):
    return subprocess.run(list(argv), input=input, stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, env=env or clean_env(),
                          cwd=cwd or tempfile.gettempdir(), timeout=timeout,
                          encoding="utf-8", errors="replace")


class CommandTest(unittest.TestCase):
    """Helpers: a command run against self.root, checked for how it ended."""

    def cli(self, *args, root=None, command=CLI, env=None, cwd=None):
        argv = list(command) + list(args)
        if root is not False:
            argv += ["--root", root or self.root]
        return run(argv, env=env, cwd=cwd)

    def ok(self, *args, **kwargs):
        proc = self.cli(*args, **kwargs)
        self.assertEqual(proc.returncode, 0, (args, proc.stdout, proc.stderr))
        self.assertNotIn("Traceback", proc.stderr)
        return proc.stdout

    def ok_json(self, *args, **kwargs):
        return json.loads(self.ok(*args, "--json", **kwargs))

    def fresh_task(self, name, files):
        """A workspace of its own (self.root) holding files, a task named
        name in it, and a server on it (closed at the end of the test)."""
        tmp = os.path.realpath(tempfile.mkdtemp(prefix="tc-cli-"))
        self.addCleanup(shutil.rmtree, tmp, True)
        self.root = os.path.join(tmp, "ws")
        for rel, text in files.items():
            write(self.root, rel, text)
        srv = Server()
        self.addCleanup(srv.close)
        srv.initialize()
        srv.ok("tc_init", root=self.root, name=name)
        return tmp, srv

    def fails(self, status, *args, **kwargs):
        """The one line on stderr of a command that must end with status."""
        proc = self.cli(*args, **kwargs)
        self.assertEqual(proc.returncode, status, (args, proc.stdout, proc.stderr))
        self.assertNotIn("Traceback", proc.stderr)
        self.assertEqual(proc.stdout, "")
        lines = proc.stderr.strip().splitlines()
        self.assertTrue(lines, args)
        return lines[-1]


class StoreInUseTest(CommandTest):
    """One workspace with three steps and a labelled capture; a server holds
    its store for the whole class (idle between calls)."""

    @classmethod
    def setUpClass(cls):
        cls._tmp = tempfile.mkdtemp(prefix="tc-cli-")
        cls.tmp = os.path.realpath(cls._tmp)
        cls.root = os.path.join(cls.tmp, "ws")
        cls.store = os.path.join(cls.root, ".checkpoints")
        write(cls.root, "src/app.py", "print('hello')\n")
        cls.srv = Server()
        cls.srv.initialize()
        cls.task_id = cls.srv.ok("tc_init", root=cls.root, name="cli task",
                                 goal="show the command line")["task_id"]
        for title, conclusion, text in STEPS:
            write(cls.root, "notes.txt", text)
            cls.srv.ok("tc_save", root=cls.root, title=title, conclusion=conclusion,
                       next="carry on")
        write(cls.root, "notes.txt", "v3, edited\n")
        cls.capture = cls.srv.ok("tc_capture", root=cls.root, label="before the migration")

    @classmethod
    def tearDownClass(cls):
        cls.srv.close()
        shutil.rmtree(cls._tmp, ignore_errors=True)

    def test_status_prints_the_handoff_health_and_store(self):
        text = self.ok("status")
        self.assertIn("Task: cli task", text)
        self.assertIn("Current step: 3 (third draft)", text)
        self.assertIn("health: ok", text)
        self.assertIn("store: %s (" % self.store, text)
        self.assertRegex(text, r"\d+(\.\d)? KB in all")
        result = self.ok_json("status")
        server = self.srv.ok("tc_resume", root=self.root)
        self.assertEqual(set(result), set(server) - {"omitted"})
        for key in ("task_id", "head", "handoff", "store", "health", "goal"):
            self.assertEqual(result[key], server[key], key)

    def test_log_lists_steps_newest_first_and_drift_records_with_labels(self):
        lines = self.ok("log").splitlines()
        self.assertIn(self.task_id, lines[0])
        rows = lines[1:]
        self.assertEqual([row.split()[0] for row in rows], ["3", "2", "1"])
        self.assertIn("third draft (head)", rows[0])
        self.assertIn("ready for review", rows[0])
        self.assertIn("the plan holds", rows[1])
        self.assertNotIn("second line", rows[1])  # the conclusion's first line only
        self.assertRegex(rows[2], r"^\s*1\s+\d+[smhd] ago\s+first draft")
        drift_id = self.capture["drift_id"]
        text = self.ok("log", "--drift")
        self.assertRegex(text, r"%s\s.*\"before the migration\"" % drift_id)
        self.assertLess(text.index(drift_id), text.index("third draft"))
        result = self.ok_json("log", "--drift")
        server = self.srv.ok("tc_show", root=self.root, include_drift=True, limit=200)
        self.assertEqual(result["steps"], server["steps"])
        labels = {d["id"]: d.get("label") for d in result["drifts"]}
        self.assertEqual(labels[drift_id], "before the migration")
        self.assertEqual(labels, {d["id"]: d.get("label") for d in server["drifts"]})

    def test_show_prints_a_step_and_its_files(self):
        text = self.ok("show", "2")
        self.assertIn("step 2", text)
        self.assertIn("title: second draft", text)
        self.assertIn("conclusion: the plan holds\n  second line of the conclusion", text)
        self.assertIn("files (2):", text)
        self.assertRegex(text, r"\n\s+\d+ B\s+file\s+notes.txt")
        self.assertRegex(text, r"\n\s+\d+ B\s+file\s+src/app.py")
        result = self.ok_json("show", "2")
        server = self.srv.ok("tc_show", root=self.root, index=2)
        self.assertEqual(result["steps"][0]["files"], server["steps"][0]["files"])
        self.assertEqual(result["steps"][0]["title"], "second draft")

    def test_capture_with_a_label_is_seen_by_the_server(self):
        write(self.root, "src/extra.py", "x = 1\n")
        text = self.ok("capture", "--label", "before the rewrite")
        self.assertRegex(text, r"^recorded d\d{4}: 1 added, 0 modified, 0 deleted "
                               r"\(before the rewrite\)")
        drift_id = text.split()[1].rstrip(":")
        drifts = self.srv.ok("tc_show", root=self.root, include_drift=True, limit=200)["drifts"]
        self.assertEqual([d.get("label") for d in drifts if d["id"] == drift_id],
                         ["before the rewrite"])
        again = self.ok_json("capture")
        self.assertFalse(again["captured"])
        # Every declared field but the two a result carries only when there
        # is something to say: what fit_result cut, and a note.
        self.assertEqual(set(again) | {"omitted", "note"},
                         set(tc_mcp.TOOLS["tc_capture"].output["properties"]))
        self.assertEqual(self.ok("capture"), "nothing changed since the last record\n")
        os.remove(os.path.join(self.root, "src", "extra.py"))
        self.srv.ok("tc_capture", root=self.root)

    def test_restore_and_undo_by_the_command_line_are_seen_by_the_server(self):
        before = read(self.root, "notes.txt")
        text = self.ok("restore", "1", "--apply")
        self.assertIn("restored step 1", text)
        recovered = text.split("recovered: ")[1].split()[0]
        self.assertRegex(recovered, r"^d\d{4}$")
        self.assertEqual(read(self.root, "notes.txt"), b"v1\n")
        resume = self.srv.ok("tc_resume", root=self.root)
        self.assertEqual(resume["head"], 1)
        self.assertIn("Current step: 1 (first draft)", resume["handoff"])
        undo = self.ok_json("undo", "--apply")
        self.assertTrue(undo["applied"])
        self.assertEqual(undo["target"], recovered, undo)
        self.assertEqual(undo["skipped_paths"], [], undo)
        self.assertEqual(read(self.root, "notes.txt"), before, undo)
        self.assertEqual(self.srv.ok("tc_resume", root=self.root)["head"], 3)
        # Undoing again brings the restore back: each undo is a restore too.
        text = self.ok("undo", "--apply")
        self.assertIn("restored %s" % undo["recovered"], text)
        self.assertEqual(read(self.root, "notes.txt"), b"v1\n")
        self.ok("undo", "--apply")
        self.assertEqual(read(self.root, "notes.txt"), before)
        self.assertEqual(self.srv.ok("tc_resume", root=self.root)["head"], 3)

    @unittest.skipUnless(RESTORE_DIFF, NO_RESTORE_DIFF)
    def test_a_restore_preview_shows_its_diff_and_changes_nothing(self):
        files = support.file_bytes(self.root)
        text = self.ok("restore", "1")
        self.assertIn("preview of restoring step 1", text)
        self.assertIn("--- a/notes.txt", text)
        self.assertIn("+++ b/notes.txt", text)
        self.assertIn("+v1", text)
        self.assertEqual(support.file_bytes(self.root), files)
        result = self.ok_json("restore", "1")
        self.assertFalse(result["applied"])
        self.assertEqual([entry["path"] for entry in result["diff"]], ["notes.txt"])
        done = self.srv.ok("tc_restore", root=self.root, index=2, apply=True)
        text = self.ok("undo")
        self.assertIn("preview of restoring %s" % done["recovered"], text)
        self.assertIn("+v3, edited", text)
        self.assertEqual(read(self.root, "notes.txt"), b"v2\n")
        self.srv.ok("tc_restore", root=self.root, drift_id=done["recovered"], apply=True)
        self.assertEqual(support.file_bytes(self.root), files)

    @unittest.skipUnless(RESTORE_DIFF, NO_RESTORE_DIFF)
    def test_diff_against_the_workspace(self):
        text = self.ok("diff", "2")
        self.assertIn("--- a/notes.txt", text)
        self.assertIn("-v3, edited", text)
        self.assertIn("+v2", text)
        stat = self.ok("diff", "2", "--stat")
        self.assertRegex(stat, r"notes.txt\s+\+1 -1")
        self.assertNotIn("+++", stat)
        self.assertEqual(self.ok_json("diff", "2")["diff"][0]["path"], "notes.txt")

    @unittest.skipUnless(SHOW_DIFF, NO_SHOW_DIFF)
    def test_diff_between_two_steps_in_the_order_given(self):
        text = self.ok("diff", "2", "3")
        self.assertIn("step 2 (-) to step 3 (+)", text)
        self.assertIn("-v2", text)
        self.assertIn("+v3", text)
        back = self.ok("diff", "s0003", "2")
        self.assertIn("-v3", back)
        self.assertIn("+v2", back)
        self.assertIn("+v3", self.ok("diff", "1", "3"))
        self.assertEqual(self.ok_json("diff", "1", "3")["diff"][0]["path"], "notes.txt")

    def test_usage_and_compress(self):
        text = self.ok("usage")
        self.assertIn("store %s: " % self.store, text)
        self.assertIn("held only by drift records: ", text)
        self.assertRegex(text, r"task %s\s+\(open\)\s+3 steps, \d+ drift records" % self.task_id)
        self.assertIn("budget: none (TC_STORE_BUDGET is not set)", text)
        usage = self.ok_json("usage")
        self.assertTrue(usage["dry_run"])
        self.assertGreater(usage["usage"]["content_bytes"], 0)
        self.assertGreater(usage["usage"]["total_bytes"], usage["usage"]["content_bytes"])
        payloads = support.stored_shas(self.store)
        text = self.ok("compress", "--dry-run", "--keep-seconds", "0")
        self.assertRegex(text, r"^would reclaim \d+ B from \d+ drift record\(s\)")
        self.assertEqual(support.stored_shas(self.store), payloads)
        result = self.ok_json("compress")
        self.assertFalse(result["dry_run"])
        self.assertEqual(result["keep_seconds"], 604800)
        self.assertEqual(result["converted"], 0)  # nothing is a week old

    def test_export_then_import_into_another_workspace(self):
        out = os.path.join(self.tmp, "out")
        os.makedirs(out, exist_ok=True)
        text = self.ok("export", out, "--history")
        package = os.path.join(out, self.task_id + "-handoff")
        self.assertIn("wrote %s (" % package, text)
        self.assertTrue(os.path.isfile(os.path.join(package, "HANDOFF.md")))
        other = os.path.join(self.tmp, "other")
        os.makedirs(other)
        text = self.ok("import", package, root=other)
        self.assertIn("task %s is active in %s" % (self.task_id, other), text)
        self.assertEqual(read(other, "notes.txt"), b"v3\n")
        self.assertEqual(self.ok_json("log", root=other)["head"], 3)
        out2 = os.path.join(self.tmp, "out2")
        os.makedirs(out2)
        exported = self.ok_json("export", out2, root=other)
        self.assertEqual(exported["path"], os.path.join(out2, self.task_id + "-handoff"))
        self.assertIn("notes.txt", exported["files"])
        third = os.path.join(self.tmp, "third")
        os.makedirs(third)
        imported = self.ok_json("import", exported["path"], root=third)
        self.assertEqual((imported["task_id"], imported["recovered"]), (self.task_id, None))

    def test_exit_status_and_one_line_errors(self):
        self.assertIn("99", self.fails(1, "show", "99"))
        self.assertIn("invalid step number 'x'", self.fails(2, "show", "x"))
        self.assertIn("restore needs TARGET", self.fails(2, "restore"))
        self.assertIn("neither a step number", self.fails(2, "restore", "abc"))
        self.assertIn("'label' is too long", self.fails(2, "capture", "--label", "x" * 201))
        self.assertIn("'keep_seconds' must be >= 0",
                      self.fails(2, "compress", "--keep-seconds", "-1"))
        self.assertIn("99", self.fails(1, "diff", "1", "99"))
        missing = os.path.join(self.tmp, "missing")
        self.assertIn("does not exist", self.fails(1, "status", root=missing))
        bare = os.path.join(self.tmp, "bare")
        os.makedirs(bare, exist_ok=True)
        self.assertIn("no active task", self.fails(1, "log", root=bare))
        self.assertFalse(os.path.exists(os.path.join(bare, ".checkpoints")))

    def test_a_subfolder_stands_for_its_workspace(self):
        deep = os.path.join(self.root, "src")
        proc = self.cli("log", root=False, cwd=deep)
        self.assertEqual(proc.returncode, 0, proc.stderr)
        self.assertIn(self.task_id, proc.stdout)

    def test_the_installed_entry_point_runs_the_commands(self):
        import test_packaging
        command = test_packaging.SharedInstall.command("tc-mcp")
        env = clean_env({"PYTHONPATH": None})
        ages = lambda text: re.sub(r"\b\d+[smhd] ago\b", "(age)", text)  # a second may pass
        self.assertEqual(ages(self.ok("log", command=[command], env=env)), ages(self.ok("log")))
        result = self.ok_json("status", command=[command], env=env)
        self.assertEqual(result["task_id"], self.task_id)
        proc = run([command, "--help"], env=env)
        self.assertEqual(proc.returncode, 0, proc.stderr)
        for name in tc_mcp.COMMANDS:
            self.assertRegex(proc.stdout, r"\n  %s\s" % name)


class WordsOnATerminalTest(CommandTest):
    """What an agent wrote reaches a person's terminal as text: no control
    character acts, no line of a conclusion passes for a field, step ids
    are taken as refs spell them, and a result's note is printed."""

    def test_titles_conclusions_ids_and_notes(self):
        tmp, srv = self.fresh_task("words", {"a.txt": "one\n"})
        srv.ok("tc_save", root=self.root, title="clear\x1b[2J\u2028Next step: forged",
               conclusion="done\nnext: forged", agent="reviewer")
        write(self.root, "a.txt", "two\n")
        srv.ok("tc_capture", root=self.root, agent="worker-7", label="mid-edit")
        srv.close()
        log = self.ok("log", "--drift")
        self.assertRegex(log, r"\"mid-edit\" by worker-7")
        drift_id = re.search(r"(d\d{4}) .*mid-edit", log).group(1)
        self.assertIn('drift record %s ("mid-edit")' % drift_id,
                      self.ok_json("restore", drift_id)["note"])
        self.assertIn("agent: reviewer", self.ok("show", "1"))
        log = self.ok("log")
        self.assertNotIn("\x1b", log)
        self.assertIn("clear\\x1b[2J\\u2028Next step: forged by reviewer", log)
        show = self.ok("show", "s0001")
        self.assertIn("conclusion: done\n  next: forged", show)
        self.assertNotIn("\nnext: forged", show)
        self.assertIn("preview of restoring step 1", self.ok("restore", "s0001"))
        copy = os.path.join(tmp, "copy")
        shutil.copytree(self.root, copy, symlinks=True)
        status = self.ok("status", root=copy)
        self.assertIn("\nnote: the workspace was moved or copied from %r" % self.root, status)


class PathsFromWhereYouAreTest(CommandTest):
    def test_a_relative_path_is_taken_from_the_current_directory(self):
        _tmp, srv = self.fresh_task("paths", {"a.py": "top v1\n", "src/a.py": "src v1\n"})
        srv.ok("tc_save", root=self.root, title="one")
        write(self.root, "a.py", "top v2\n")
        write(self.root, "src/a.py", "src v2\n")
        srv.close()
        src = os.path.join(self.root, "src")
        proc = self.cli("restore", "1", "a.py", "--apply", root=False, cwd=src)
        self.assertEqual(proc.returncode, 0, proc.stderr)
        self.assertEqual((read(self.root, "src/a.py"), read(self.root, "a.py")),
                         (b"src v1\n", b"top v2\n"))
        self.ok("restore", "1", os.path.join(self.root, "a.py"), "--apply")  # absolute
        self.assertEqual(read(self.root, "a.py"), b"top v1\n")
        self.assertIn("outside the workspace", self.fails(2, "restore", "1", "../elsewhere",
                                                          root=False, cwd=src + "/.."))


class UndoWithNothingToUndoTest(CommandTest):
    def test_undo_without_a_restore_is_refused(self):
        self.fresh_task("nothing to undo", {"a.txt": "a\n"})
        self.assertIn("nothing to undo", self.fails(1, "undo"))
        self.assertIn("nothing to undo", self.fails(1, "undo", "--apply"))


class UnknownWordsTest(CommandTest):
    """A word the command line does not know: a client's extra argument
    (stdin a pipe) starts the server; a person's typo (stdin a terminal) is
    bad usage."""

    def test_with_pipes_the_server_starts(self):
        ping = '{"jsonrpc":"2.0","id":1,"method":"ping"}\n'
        proc = run(list(CLI) + ["restor", "2"], input=ping)
        self.assertEqual(proc.returncode, 0, proc.stderr)
        self.assertEqual(json.loads(proc.stdout)["result"], {})
        self.assertIn("ignoring unrecognised argument(s): restor 2", proc.stderr)

    @unittest.skipUnless(hasattr(os, "openpty"), "needs a pseudo-terminal")
    def test_at_a_terminal_it_prints_the_usage_and_exits_2(self):
        main, terminal = os.openpty()
        self.addCleanup(os.close, main)
        try:
            proc = subprocess.Popen(list(CLI) + ["restor", "2"], stdin=terminal,
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                    env=clean_env())
        finally:
            os.close(terminal)
        out, err = proc.communicate(timeout=30)
        self.assertEqual(proc.returncode, 2, err)
        self.assertEqual(out, b"")
        err = err.decode("utf-8", "replace")
        self.assertIn("usage: tc-mcp", err)
        self.assertIn("unrecognised argument(s): restor 2", err)

    def test_help_lists_the_commands(self):
        proc = run(list(CLI) + ["--help"])
        self.assertEqual(proc.returncode, 0, proc.stderr)
        for name in tc_mcp.COMMANDS:
            self.assertRegex(proc.stdout, r"\n  %s\s" % name)
        proc = run(list(CLI) + ["log", "--help"])
        self.assertEqual(proc.returncode, 0, proc.stderr)
        self.assertIn("--drift", proc.stdout)
        self.assertIn("--json", proc.stdout)


class NothingWrittenOutsideTest(CommandTest):
    """Every command writes only in the workspace, its store and (export)
    the folder it was given: not in the folders around them, not in HOME,
    not in the temporary folder."""

    def test_commands_write_only_the_workspace_and_store(self):
        tmp = os.path.realpath(tempfile.mkdtemp(prefix="tc-cli-"))
        self.addCleanup(shutil.rmtree, tmp, True)
        self.root = os.path.join(tmp, "ws")
        write(self.root, "a.txt", "one\n")
        out = os.path.join(tmp, "out")
        for folder in ("home", "tmp", "out", "beside"):
            os.makedirs(os.path.join(tmp, folder))
        env = clean_env({"HOME": os.path.join(tmp, "home"), "TMPDIR": os.path.join(tmp, "tmp")})
        srv = Server(cwd=tmp)
        self.addCleanup(srv.close)
        srv.initialize()
        srv.ok("tc_init", root=self.root, name="tidy")
        srv.ok("tc_save", root=self.root, title="one")
        before = [entry for entry in support.tree_listing(tmp) if not entry[0].startswith("ws")]
        write(self.root, "a.txt", "two\n")
        for args in (["status"], ["log", "--drift"], ["show", "1"], ["capture", "--label", "x"],
                     ["restore", "1", "--apply"], ["undo", "--apply"], ["usage"],
                     ["compress", "--dry-run"], ["export", out]):
            proc = self.cli(*args, env=env, cwd=os.path.join(tmp, "beside"))
            self.assertEqual(proc.returncode, 0, (args, proc.stderr))
        after = [entry for entry in support.tree_listing(tmp)
                 if not entry[0].startswith(("ws", os.path.join("out", "")))]
        self.assertEqual(after, before)
        self.assertTrue(os.listdir(out))
        self.assertEqual(read(self.root, "a.txt"), b"two\n")


if __name__ == "__main__":
    unittest.main()
