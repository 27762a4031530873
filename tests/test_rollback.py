"""The journal and its rollback: a restore or an import that fails, or whose
process is killed, is undone.

Before a restore or an import changes the workspace it writes a journal: its
plan, and the content it will need to put back. A failure rolls it back in
the same call; a killed process leaves the journal to the next call that
takes the store lock, which rolls it back first. Either way the workspace
comes back as it was before the operation, unsaved edits included, and the
store goes on. What cannot be put back (another program took the path, or
wrote the file meanwhile) is left as it is, named, and its old content kept
in the store and listed under kept/.

The tests with killed servers draw their moments and their files from
CRASH_SEED (see tests/support.py): set it to replay a run.
"""

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import unittest

import support
from support import (SCRIPTS, EditedMeanwhileTest, SeededTest, WorkspaceTest, can_symlink,
                     fill_workspace, kill_and_collect, mutate, read, send, sha, snapshot,
                     store_problems, write)

sys.path.insert(0, SCRIPTS)
import tc  # noqa: E402


class KeptListTest(unittest.TestCase):

    def test_a_rollback_run_again_adds_to_what_its_first_run_kept(self):
        store_dir = tempfile.mkdtemp(prefix="tc-kept-")
        self.addCleanup(shutil.rmtree, store_dir, True)
        store = tc.Store(store_dir, lambda line: None)
        data = {"op": "restore", "op_id": "restore-1-abcd", "root": "/nowhere"}
        one, two, three = ("%064x" % n for n in (1, 2, 3))
        kept = tc.KeptList(store, data["op"], data["op_id"], data["root"])
        kept.write({}, {"a.txt": [one, 0o644]})  # a first run, cut short
        kept.write({"b.txt": [two, 0o644]}, {"c.txt": [three, 0o600]})
        with open(os.path.join(store_dir, "kept", "restore-1-abcd.json"), encoding="utf-8") as fh:
            doc = json.load(fh)
        self.assertEqual(doc["files"], {"b.txt": [two, 0o644]})
        self.assertEqual(doc["edited"], {"a.txt": [one, 0o644], "c.txt": [three, 0o600]})


class RollbackLogTest(unittest.TestCase):

    def test_a_rollback_that_keeps_failing_is_logged_once(self):
        store_dir = tempfile.mkdtemp(prefix="tc-rollback-")
        self.addCleanup(shutil.rmtree, store_dir, True)
        journal = os.path.join(store_dir, "journal", "restore-1-abcd")
        os.makedirs(journal)
        # The record to put back is now a folder: writing it back fails each time.
        os.makedirs(os.path.join(store_dir, "tasks", "t", "state.json", "inside"))
        write(journal, "backup-0", "{}")
        plan = {"op": "restore", "op_id": "restore-1-abcd", "root": store_dir, "entries": [],
                "created_dirs": [], "store_new": [], "store_new_dirs": [],
                "store_backup": {"tasks/t/state.json": "backup-0"}, "payloads_new": []}
        write(journal, "plan.json", json.dumps(plan))
        lines = []
        store = tc.Store(store_dir, lines.append)
        for _ in range(5):
            with store.lock:
                pass
        failures = [line for line in lines if "failed" in line]
        self.assertEqual(len(failures), 1, lines)
        self.assertEqual(len(lines), 2, lines)
        os.rmdir(os.path.join(store_dir, "tasks", "t", "state.json", "inside"))
        os.rmdir(os.path.join(store_dir, "tasks", "t", "state.json"))
        with store.lock:
            pass
        self.assertFalse(os.path.exists(journal))
        self.assertIn("after all", lines[-1])


class RollbackAroundOtherWrites(EditedMeanwhileTest):
    """A restore or an import that fails is rolled back in the same call;
    what another program wrote meanwhile stays as that program left it."""

    def fail_when_recording(self, first=None):
        """The restore's own record meets a full disk, once its files are
        written (and after first(), when given)."""
        original = tc.Recorder.record_drift

        def full_disk(cp, *args, **kwargs):
            if first is not None:
                first()
            raise OSError(28, "No space left on device")

        tc.Recorder.record_drift = full_disk
        self.addCleanup(setattr, tc.Recorder, "record_drift", original)

    def failed_restore(self, first=None):
        """The error of a restore to step 1 whose record meets a full disk
        (see fail_when_recording)."""
        self.fail_when_recording(first=first)
        with self.assertRaises(tc.CheckpointError) as caught:
            self.cp.restore(self.root, index=1, apply=True)
        return str(caught.exception)

    def test_a_failed_restore_rolls_back_around_a_file_written_meanwhile(self):
        self.two_steps()
        self.edit_once_the_journal_is_written({"replaced.txt": b"meanwhile\n"})
        error = self.failed_restore()
        self.assertIn("nothing was changed", error)
        self.assertEqual(self.read("replaced.txt"), b"meanwhile\n")
        self.assertEqual(self.read("plain.txt"), b"plain 2, longer\n")
        self.assertEqual(self.read("deleted.txt"), b"only at step 2\n")

    def test_a_crash_after_a_file_was_left_does_not_roll_it_back(self):
        # The restore's process dies once it has written its files; the next
        # process rolls it back, and leaves the file written meanwhile alone.
        self.two_steps()
        script = (
            "import os, sys\n"
            "sys.path.insert(0, %r)\n"
            "import tc\n"
            "begin = tc.Journal.begin\n"
            "def edit(journal, *args, **kwargs):\n"
            "    begin(journal, *args, **kwargs)\n"
            "    with open(os.path.join(%r, 'replaced.txt'), 'wb') as fh:\n"
            "        fh.write(b'written meanwhile\\n')\n"
            "tc.Journal.begin = edit\n"
            "tc.Recorder.record_drift = lambda *args, **kwargs: os._exit(9)\n"
            "tc.Checkpoints(tc.Config(watch=False, git=False)).restore(%r, index=1, apply=True)\n"
        ) % (support.SCRIPTS, self.root, self.root)
        died = subprocess.run([sys.executable, "-c", script], capture_output=True, timeout=120)
        self.assertEqual(died.returncode, 9, died.stderr)
        self.assertEqual(self.read("plain.txt"), b"plain 1\n")  # the restore got that far
        resumed = tc.Checkpoints(tc.Config(watch=False, git=False)).resume(self.root)
        self.assertEqual(self.read("plain.txt"), b"plain 2, longer\n")  # rolled back
        self.assertEqual(self.read("replaced.txt"), b"written meanwhile\n")  # left alone
        self.assertEqual(resumed["drift_paths"], ["replaced.txt"])

    def test_a_failed_restore_leaves_what_was_written_over_its_own_writes(self):
        # Another program saves a file after the restore wrote it; then the
        # restore fails and is rolled back: that save stays, the file is
        # named as not put back, and what it held before is kept.
        self.two_steps()
        error = self.failed_restore(first=lambda: self.write("plain.txt", "the editor's save\n"))
        self.assertIn("'plain.txt'", error)
        self.assertEqual(self.read("plain.txt"), b"the editor's save\n")
        self.assertEqual(self.read("replaced.txt"), b"replaced at step 2, longer\n")  # put back
        kept = os.listdir(os.path.join(self.store, "kept"))
        self.assertEqual(len(kept), 1, kept)
        with open(os.path.join(self.store, "kept", kept[0]), encoding="utf-8") as fh:
            before = json.load(fh)["files"]["plain.txt"][0]
        self.assertEqual(before, sha(b"plain 2, longer\n"))
        with open(os.path.join(self.store, "payload", before[:2], before), "rb") as fh:
            self.assertEqual(fh.read(), b"plain 2, longer\n")

    def test_a_failed_restore_that_turned_a_file_into_a_folder_is_undone_whole(self):
        # The folder the restore made where a file was is its own doing.
        self.folder_then_file("a/b", "a file at step 2\n")
        error = self.failed_restore()
        self.assertIn("nothing was changed", error)
        self.assertEqual(self.read("a"), b"a file at step 2\n")

    def test_a_file_the_restore_made_and_another_program_wrote_stays_and_is_named(self):
        self.two_steps()
        error = self.failed_restore(first=lambda: self.write("written.txt", "the editor's\n"))
        self.assertIn("'written.txt'", error)
        self.assertEqual(self.read("written.txt"), b"the editor's\n")
        self.assertEqual(self.read("plain.txt"), b"plain 2, longer\n")

    def test_a_rollback_retried_at_the_next_lock_keeps_to_the_first_ones_scope(self):
        # The in-process rollback fails when it lists kept content (the disk
        # is still full); the next call retries it: the editor's save stays.
        self.two_steps()
        self.fail_when_recording(first=lambda: self.write("plain.txt", "the editor's save\n"))
        original = tc.write_json

        def kept_list_meets_a_full_disk(path, *args, **kwargs):
            if os.sep + "kept" + os.sep in path:
                tc.write_json = original
                raise OSError(28, "No space left on device")
            return original(path, *args, **kwargs)

        tc.write_json = kept_list_meets_a_full_disk
        self.addCleanup(setattr, tc, "write_json", original)
        with self.assertRaises(tc.CheckpointError) as caught:
            self.cp.restore(self.root, index=1, apply=True)
        self.assertIn("could not be fully undone yet", str(caught.exception))
        resumed = tc.Checkpoints(tc.Config(watch=False, git=False)).resume(self.root)
        self.assertTrue(resumed["health"]["ok"], resumed["health"])
        self.assertEqual(self.read("plain.txt"), b"the editor's save\n")
        self.assertEqual(self.read("replaced.txt"), b"replaced at step 2, longer\n")
        journals = os.path.join(self.store, "journal")
        self.assertFalse(os.path.isdir(journals) and os.listdir(journals))  # rolled back

    def test_a_write_that_failed_is_told_from_one_made_after_it(self):
        # A damaged stored copy fails the restore's write of plain.txt; an
        # editor saves plain.txt before the rollback: the save stays.
        self.two_steps()
        step_one = self.step_files(1)["plain.txt"]
        with open(os.path.join(self.store, "payload", step_one[:2], step_one), "r+b") as fh:
            fh.write(b"X")
        original = tc.Journal.rollback

        def editor_then_rollback(journal):
            self.write("plain.txt", "the editor's save, much longer than that\n")
            return original(journal)

        tc.Journal.rollback = editor_then_rollback
        self.addCleanup(setattr, tc.Journal, "rollback", original)
        with self.assertRaises(tc.CheckpointError):
            self.cp.restore(self.root, index=1, apply=True)
        self.assertEqual(self.read("plain.txt"), b"the editor's save, much longer than that\n")

    def test_a_failed_import_leaves_alone_what_it_never_reached(self):
        # An empty folder x, where the package has a file, gains a file: the
        # import fails there and is rolled back; y.txt, which another program
        # made meanwhile and the import never reached, stays.
        self.write("x", "file x\n")
        self.write("y.txt", "y from the package\n")
        self.cp.init(self.root, "import")
        self.cp.save(self.root, "one")
        out = os.path.join(self.tmp, "out")
        os.makedirs(out)
        package = self.cp.export(self.root, out)["path"]
        other = os.path.join(self.tmp, "other")
        os.makedirs(os.path.join(other, "x"))
        self.root = other
        self.edit_once_the_journal_is_written({"x/new.txt": b"new inside x\n",
                                               "y.txt": b"made meanwhile\n"})
        with self.assertRaises(tc.CheckpointError):
            self.cp.import_package(other, package)
        self.assertEqual(self.read("y.txt"), b"made meanwhile\n")
        self.assertEqual(self.read("x/new.txt"), b"new inside x\n")


class RolledBackFilesAreNotUnsavedWork(WorkspaceTest):
    """A rollback writes back what files held before the restore; their
    times move, their content is what the index says. tc_resume must not
    list them as unsaved work afterwards."""

    FILES = 40

    def setUp(self):
        super().setUp()
        for n in range(self.FILES):
            self.write("src/f%02d.txt" % n, "first %d\n" % n)
        self.cp = tc.Checkpoints(tc.Config(watch=False, git=False))
        self.cp.init(self.root, "rollback")
        self.cp.save(self.root, "one")
        for n in range(self.FILES):
            self.write("src/f%02d.txt" % n, "second, longer %d\n" % n)
        self.cp.save(self.root, "two")
        time.sleep(0.05)
        self.write("unsaved.txt", "not recorded yet\n")
        self.before = snapshot(self.root)

    def assert_only_the_unsaved_file_is_listed(self):
        # (A new process rolls a dead one's restore back at its first lock.)
        resumed = tc.Checkpoints(tc.Config(watch=False, git=False)).resume(self.root)
        self.assertEqual(snapshot(self.root), self.before)
        self.assertEqual(resumed["drift_paths"], ["unsaved.txt"])
        self.assertTrue(resumed["health"]["ok"], resumed["health"])
        # The next save records what the files put back hold.
        saved = self.cp.save(self.root, "two again")
        files = self.cp.show(self.root, index=saved["index"], limit=200)["steps"][0]["files"]
        self.assertEqual({f["path"]: f["sha256"] for f in files},
                         {rel: hashlib.sha256(data).hexdigest()
                          for rel, (data, _mode) in self.before.items()})

    def test_after_a_restore_that_failed_and_was_undone(self):
        original = tc.Recorder.record_drift

        def full_disk(cp, *args, **kwargs):
            raise OSError(28, "No space left on device")

        tc.Recorder.record_drift = full_disk
        self.addCleanup(setattr, tc.Recorder, "record_drift", original)
        with self.assertRaises(tc.CheckpointError):
            self.cp.restore(self.root, index=1, apply=True)
        tc.Recorder.record_drift = original
        self.assert_only_the_unsaved_file_is_listed()

    def test_after_a_restore_whose_process_died_midway(self):
        # The process ends at once (no clean-up) once every file is written.
        script = (
            "import os, sys\n"
            "sys.path.insert(0, %r)\n"
            "import tc\n"
            "tc.Recorder.record_drift = lambda *args, **kwargs: os._exit(9)\n"
            "tc.Checkpoints(tc.Config(watch=False, git=False)).restore(%r, index=1, apply=True)\n"
        ) % (SCRIPTS, self.root)
        died = subprocess.run([sys.executable, "-c", script], capture_output=True, timeout=120)
        self.assertEqual(died.returncode, 9, died.stderr)
        self.assertEqual(self.read("src/f00.txt"), b"first 0\n")  # it got that far
        self.assertTrue(os.listdir(os.path.join(self.store, "journal")))
        self.assert_only_the_unsaved_file_is_listed()


class KilledRestoreTest(SeededTest):
    """A restore killed midway, its journal left for the next server."""

    def interrupted_restore(self, srv, root, journal_base, ready=None):
        """Kill srv while a restore of root to step 1 has its journal on disk
        and has written over some of the files (or, with ready, once
        ready() holds)."""
        ready = ready or (lambda: self.some_written(root, journal_base))
        for _attempt in range(5):
            request_id = send(srv, "tc_restore", root=root, index=1, apply=True)
            deadline = time.monotonic() + 20
            while time.monotonic() < deadline and not ready():
                pass
            answer = kill_and_collect(srv, request_id)
            if answer is None and os.listdir(journal_base):
                return
            srv = self.server()  # it finished first: undo it and try again
            if answer is not None:
                srv.ok("tc_restore", root=root,
                       drift_id=answer["result"]["structuredContent"]["recovered"], apply=True)
        self.fail("the restore always finished before it could be killed")

    @staticmethod
    def some_written(root, journal_base):
        try:
            (name,) = os.listdir(journal_base)
            plan = os.path.join(journal_base, name, "plan.json")
            with open(plan, encoding="utf-8") as fh:
                entries = json.load(fh)["entries"]
            started = os.stat(plan).st_mtime_ns
        except (OSError, ValueError):
            return False
        for rel, before, *_after in entries:
            try:
                if before and os.stat(os.path.join(root, rel)).st_mtime_ns >= started:
                    return True
            except OSError:
                continue
        return False

    def restore_cut_short(self, name):
        """A task with one step, unsaved edits to most files, and a restore
        to the step killed midway: (the workspace before the restore, the
        journal folder, the plan's entries [rel, before, after])."""
        names = fill_workspace(self.root, self.rng, files=600, big=4)
        srv = self.server()
        srv.ok("tc_init", root=self.root, name=name)
        srv.ok("tc_save", root=self.root, title="one")
        mutate(self.root, self.rng, names, "unsaved", share=0.9)
        before = snapshot(self.root)
        journal_base = os.path.join(self.store, "journal")
        self.interrupted_restore(srv, self.root, journal_base)
        plan = os.path.join(journal_base, os.listdir(journal_base)[0], "plan.json")
        with open(plan, encoding="utf-8") as fh:
            return before, journal_base, json.load(fh)["entries"]


class RollbackWaitsForItsWorkspace(KilledRestoreTest):
    """A restore killed midway in a workspace whose store is elsewhere. While
    the workspace may come back (its disk not mounted: nothing there, or an
    empty mount point) its rollback waits, and nothing is written into the
    stand-in. A workspace that was removed (the folder that held it is still
    the same folder) has its records rolled back, and the store goes on."""

    def setUp(self):
        super().setUp()
        self.disk = os.path.join(self.tmp, "disk")  # stands for a mount point
        self.ws = os.path.join(self.disk, "ws")
        self.shared = os.path.join(self.tmp, "shared-store")
        self.other = os.path.join(self.tmp, "other")
        os.makedirs(self.other)
        self.journal_base = os.path.join(self.shared, "journal")

    def prepare(self):
        """A half-done restore of self.ws; the workspace as it was before it."""
        names = fill_workspace(self.ws, self.rng, files=600, big=4)
        srv = self.server()
        srv.ok("tc_init", root=self.ws, name="away", store=self.shared)
        srv.ok("tc_save", root=self.ws, title="one")
        mutate(self.ws, self.rng, names, "unsaved", share=0.9)
        before = snapshot(self.ws)
        srv.ok("tc_init", root=self.other, name="neighbour", store=self.shared)
        self.interrupted_restore(srv, self.ws, self.journal_base)
        return before

    def assert_waiting(self, srv, pending):
        health = srv.ok("tc_resume", root=self.other)["health"]
        self.assertFalse(health["ok"])
        self.assertTrue(any(self.ws in error for error in health["errors"]), health)
        refused = srv.call("tc_save", root=self.other, title="blocked")
        self.assertTrue(refused.is_error)
        self.assertIn(self.ws, refused.text)
        self.assertIn(os.path.join(self.journal_base, pending[0]), refused.text)
        self.assertEqual(os.listdir(self.journal_base), pending)

    def test_a_rollback_waits_while_its_disk_is_not_mounted(self):
        before = self.prepare()
        pending = os.listdir(self.journal_base)
        away = self.disk + "-away"
        os.rename(self.disk, away)  # unmounted: the mount point is another, empty folder
        os.mkdir(self.disk)
        srv = self.server()
        self.assert_waiting(srv, pending)
        os.rmdir(self.disk)
        os.rename(away, self.disk)
        os.rename(self.ws, self.ws + "-tmp")
        os.mkdir(self.ws)  # the workspace was the mount point: now empty
        self.assert_waiting(srv, pending)
        self.assertEqual(os.listdir(self.ws), [], "the rollback wrote into the stand-in")
        srv.close()

        os.rmdir(self.ws)
        os.rename(self.ws + "-tmp", self.ws)  # mounted again
        srv = self.server()
        srv.ok("tc_show", root=self.ws)
        self.assertEqual(os.listdir(self.journal_base) if os.path.isdir(self.journal_base)
                         else [], [])
        self.assertTrue(snapshot(self.ws) == before, "the unsaved edits did not come back")
        self.assertEqual(srv.ok("tc_save", root=self.other, title="free again")["index"], 1)
        self.assertTrue(srv.ok("tc_resume", root=self.ws)["health"]["ok"])

    def test_a_removed_workspace_does_not_block_the_store_and_its_content_is_kept(self):
        self.prepare()
        plan = os.path.join(self.journal_base, os.listdir(self.journal_base)[0], "plan.json")
        with open(plan, encoding="utf-8") as fh:
            undo = {rel: before[0] for rel, before, *_after in json.load(fh)["entries"]
                    if before}
        moved = self.ws + "-moved"
        os.rename(self.ws, moved)  # gone from where it was (moved, or thrown away)
        srv = self.server()
        self.assertTrue(srv.ok("tc_resume", root=self.other)["health"]["ok"])
        self.assertEqual(srv.ok("tc_save", root=self.other, title="goes on")["index"], 1)
        self.assertEqual(os.listdir(self.journal_base) if os.path.isdir(self.journal_base)
                         else [], [])
        self.assertEqual(store_problems(self.shared), [])
        # What the files held before the restore stays, named, through a compress.
        srv.ok("tc_compress", root=self.other, keep_seconds=0, minimum=0, maximum=0)
        kept_dir = os.path.join(self.shared, "kept")
        (kept,) = os.listdir(kept_dir)
        with open(os.path.join(kept_dir, kept), encoding="utf-8") as fh:
            listed = json.load(fh)
        self.assertEqual(listed["root"], self.ws)
        self.assertEqual({rel: before[0] for rel, before in listed["files"].items()}, undo)
        for sha in undo.values():
            self.assertTrue(os.path.exists(os.path.join(self.shared, "payload", sha[:2], sha)))

    def test_a_workspace_renamed_with_its_store_is_rolled_back_where_it_is_now(self):
        names = fill_workspace(self.root, self.rng, files=600, big=4)
        srv = self.server()
        srv.ok("tc_init", root=self.root, name="renamed")
        srv.ok("tc_save", root=self.root, title="one")
        mutate(self.root, self.rng, names, "unsaved", share=0.9)
        before = snapshot(self.root)
        self.interrupted_restore(srv, self.root,
                                 os.path.join(self.root, ".checkpoints", "journal"))
        renamed = self.root + "-renamed"
        os.rename(self.root, renamed)
        self.server().call("tc_resume", root=renamed)  # its lock rolls the journal back
        self.assertTrue(snapshot(renamed) == before, "the unsaved edits did not come back")
        self.assertEqual(os.listdir(os.path.join(renamed, ".checkpoints", "journal"))
                         if os.path.isdir(os.path.join(renamed, ".checkpoints", "journal"))
                         else [], [])


class RollbackMeetsATakenPath(KilledRestoreTest):
    """After a crash mid-restore, the user made something at the path of a
    file the rollback would put back: a folder with a file in it where the
    file was, a file where its folder was. The rollback leaves what is
    there, puts every other file back, keeps the content it could not put
    back, and the store goes on."""

    def test_the_rollback_leaves_a_taken_path_alone_and_keeps_its_content(self):
        before, journal_base, entries = self.restore_cut_short("taken")
        undo = {rel: old[0] for rel, old, *_after in entries if old}
        first = sorted(undo)[0]
        folder = next(rel.rsplit("/", 1)[0] for rel in sorted(undo)
                      if not rel.startswith(first.split("/")[0] + "/"))
        victim = os.path.join(self.root, *first.split("/"))
        if os.path.exists(victim):
            os.remove(victim)
        write(victim, "mine.txt", b"made after the crash\n")
        shutil.rmtree(os.path.join(self.root, *folder.split("/")))
        write(self.root, folder, b"a file where a folder was\n")
        taken = {rel for rel in undo if rel == first or rel.startswith(folder + "/")}

        srv = self.server()
        self.assertEqual(srv.ok("tc_save", root=self.root, title="goes on")["index"], 2)
        self.assertEqual(os.listdir(journal_base) if os.path.isdir(journal_base) else [], [])
        now = snapshot(self.root)
        self.assertEqual(now[first + "/mine.txt"][0], b"made after the crash\n")
        self.assertEqual(now[folder][0], b"a file where a folder was\n")
        for rel, data in before.items():
            if rel != first and not rel.startswith(folder + "/"):
                self.assertTrue(now.get(rel) == data, "%s was not put back" % rel)
        (kept,) = os.listdir(os.path.join(self.store, "kept"))
        with open(os.path.join(self.store, "kept", kept), encoding="utf-8") as fh:
            listed = json.load(fh)["files"]
        self.assertEqual({rel: sha for rel, (sha, _mode) in listed.items()},
                         {rel: undo[rel] for rel in taken})
        srv.ok("tc_compress", root=self.root, keep_seconds=0, minimum=0, maximum=0)
        for rel in taken:
            sha = undo[rel]
            with open(os.path.join(self.store, "payload", sha[:2], sha), "rb") as fh:
                self.assertEqual(hashlib.sha256(fh.read()).hexdigest(), sha)
        self.assertTrue(srv.ok("tc_resume", root=self.root)["health"]["ok"])


class EditsAfterTheCrash(KilledRestoreTest):
    """Files edited between a crash mid-restore and the rollback at the next
    call: the rollback still puts the workspace back as it was before the
    restore, but keeps what the edits made first."""

    def test_what_files_held_when_the_rollback_found_them_is_kept(self):
        before, journal_base, entries = self.restore_cut_short("edits")
        replaced = [rel for rel, old, new in entries if old and new]
        deleted = next(rel for rel, old, new in entries if old and not new)
        written = next(rel for rel, old, new in entries if not old)
        edits = {rel: ("edited after the crash: %s\n" % rel).encode()
                 for rel in (replaced[0], deleted, written)}
        for rel, data in edits.items():
            write(self.root, rel, data)
        # One edited past what is ever stored (sparse: no room taken) stays as it is.
        huge = os.path.join(self.root, *replaced[1].split("/"))
        os.truncate(huge, 101 * 1024 * 1024)
        srv = self.server()
        shown = srv.ok("tc_show", root=self.root)  # its lock rolls the journal back
        self.assertEqual(os.listdir(journal_base) if os.path.isdir(journal_base) else [], [])
        # The call that only reads says what its lock did, and so does the store's log.
        self.assertIn("an interrupted restore", shown["note"] or "")
        self.assertIn("rolled back first", shown["note"])
        self.assertIn("had been edited since (%r" % sorted(edits)[0], shown["note"])
        with open(os.path.join(self.store, "server.log"), encoding="utf-8") as fh:
            self.assertIn("rolled back first", fh.read())
        self.assertIsNone(srv.ok("tc_show", root=self.root).get("note"), "said once")
        self.assertEqual(os.path.getsize(huge), 101 * 1024 * 1024)
        now = snapshot(self.root)
        del now[replaced[1]], before[replaced[1]]
        self.assertTrue(now == before, "the workspace did not come back")
        (kept,) = os.listdir(os.path.join(self.store, "kept"))
        with open(os.path.join(self.store, "kept", kept), encoding="utf-8") as fh:
            doc = json.load(fh)
        listed = doc["edited"]
        self.assertEqual(list(doc["files"]), [replaced[1]])
        self.assertNotIn(replaced[1], listed)
        for rel, data in edits.items():
            sha = hashlib.sha256(data).hexdigest()
            self.assertEqual(listed[rel][0], sha, rel)
            with open(os.path.join(self.store, "payload", sha[:2], sha), "rb") as fh:
                self.assertEqual(fh.read(), data)


class KeptContentOutlivesCompress(KilledRestoreTest):

    def test_content_a_rollback_kept_survives_a_compress_of_its_twins(self):
        names = fill_workspace(self.root, self.rng, files=600, big=4)
        srv = self.server()
        srv.ok("tc_init", root=self.root, name="kept")
        srv.ok("tc_save", root=self.root, title="one")
        mutate(self.root, self.rng, names, "unsaved", share=0.9)
        victim = names[0]
        precious = b"unsaved, and soon only in the store\n"
        # The same bytes once recorded for another path, in a drift compress may reclaim.
        write(self.root, "twin.txt", precious)
        srv.ok("tc_capture", root=self.root)
        write(self.root, "twin.txt", b"changed since\n")
        srv.ok("tc_capture", root=self.root)
        write(self.root, victim, precious)  # recorded by no drift
        journal_base = os.path.join(self.store, "journal")
        self.interrupted_restore(srv, self.root, journal_base)
        full = os.path.join(self.root, *victim.split("/"))
        if os.path.exists(full):
            os.remove(full)
        write(full, "mine.txt", b"a folder made after the crash\n")
        srv = self.server()
        srv.ok("tc_save", root=self.root, title="two")
        srv.ok("tc_compress", root=self.root, keep_seconds=0, minimum=0, maximum=0)
        sha = hashlib.sha256(precious).hexdigest()
        with open(os.path.join(self.store, "payload", sha[:2], sha), "rb") as fh:
            self.assertEqual(fh.read(), precious)


class RollbackThroughTheRestoresOwnFolders(KilledRestoreTest):

    def interrupted_over_a_file(self, nested):
        """Step one has folders (nested) where the workspace now has a file
        'a' with unsaved edits; a restore to step one killed after it made
        those folders. Returns the workspace as it was before the restore."""
        names = fill_workspace(self.root, self.rng, files=600, big=4)
        folder = self.root
        for part in nested.split("/")[:-1]:  # one at a time: os.makedirs recurses
            folder = os.path.join(folder, part)
            os.mkdir(folder)
        write(self.root, nested, b"in step one\n")
        srv = self.server()
        srv.ok("tc_init", root=self.root, name="nested")
        srv.ok("tc_save", root=self.root, title="one")
        folders = [os.path.join(self.root, *nested.split("/")[:n])
                   for n in range(1, nested.count("/") + 1)]
        os.remove(os.path.join(self.root, *nested.split("/")))
        for folder in reversed(folders):  # deepest first (shutil.rmtree recurses)
            os.rmdir(folder)
        write(self.root, "a", b"unsaved edits in a file named a\n")
        mutate(self.root, self.rng, names, "unsaved", share=0.9)
        before = snapshot(self.root)
        deepest = os.path.join(self.root, *nested.split("/"))
        self.interrupted_restore(srv, self.root, os.path.join(self.store, "journal"),
                                 ready=lambda: os.path.exists(deepest))
        self.assertTrue(os.path.isdir(folders[-1]),
                        "the restore was killed before it made the folders")
        return before

    def roll_back(self):
        self.server().ok("tc_show", root=self.root)  # its lock rolls the journal back
        journal_base = os.path.join(self.store, "journal")
        self.assertEqual(os.listdir(journal_base) if os.path.isdir(journal_base) else [], [])

    def test_a_file_where_the_restore_made_folders_is_put_back(self):
        before = self.interrupted_over_a_file("a/x/y.txt")
        self.roll_back()
        self.assertTrue(snapshot(self.root) == before, "the workspace did not come back")
        kept = os.path.join(self.store, "kept")
        for name in os.listdir(kept) if os.path.isdir(kept) else []:
            with open(os.path.join(kept, name), encoding="utf-8") as fh:
                self.assertEqual(json.load(fh)["files"], {}, "a file was not put back")

    def test_a_file_where_the_restore_made_a_thousand_folders_deep_is_put_back(self):
        before = self.interrupted_over_a_file("a/" + "d/" * 1100 + "y.txt")
        self.roll_back()
        self.assertTrue(snapshot(self.root) == before, "the workspace did not come back")

    def test_folders_made_in_them_after_the_crash_are_left_alone(self):
        before = self.interrupted_over_a_file("a/x/y.txt")
        for n in range(10):
            os.mkdir(os.path.join(self.root, "a", "e%d" % n))
        write(self.root, "a/x/notes.txt", b"made after the crash\n")
        self.roll_back()
        self.assertEqual(sorted(os.listdir(os.path.join(self.root, "a"))),
                         ["e%d" % n for n in range(10)] + ["x"])
        self.assertEqual(os.listdir(os.path.join(self.root, "a", "x")), ["notes.txt"])
        (kept,) = os.listdir(os.path.join(self.store, "kept"))
        with open(os.path.join(self.store, "kept", kept), encoding="utf-8") as fh:
            listed = json.load(fh)["files"]
        self.assertEqual(listed["a"][0], hashlib.sha256(before["a"][0]).hexdigest())


class WorkspaceMovedBehindALink(WorkspaceTest):
    """A restore cut short, then its workspace moved elsewhere with a link
    left at the old path: the rollback still puts the files back."""

    @unittest.skipUnless(can_symlink(), "needs the right to make symlinks")
    def test_a_restore_cut_short_is_undone_after_its_folder_moved_behind_a_link(self):
        names = ["sub/f%02d.txt" % n for n in range(20)]
        for name in names:
            self.write(name, "old\n")
        cp = tc.Checkpoints(tc.Config(watch=False, git=False))
        cp.init(self.root, "moved")
        cp.save(self.root, "one")
        for name in names:
            self.write(name, "unsaved work\n")
        # The restore dies after 10 files, its journal left for the next
        # server (what a kill leaves; here the rollback is kept from running).
        real_write, real_undo = tc.PayloadStore.write_over, tc.undo_failed_operation
        calls = []

        def dying_write(*args, **kwargs):
            calls.append(1)
            if len(calls) > 10:
                raise OSError(5, "the server died here")
            return real_write(*args, **kwargs)

        def no_rollback(cp_, journal, what, exc):
            raise exc

        tc.PayloadStore.write_over, tc.undo_failed_operation = dying_write, no_rollback
        try:
            with self.assertRaises(OSError):
                cp.restore(self.root, index=1, apply=True)
        finally:
            tc.PayloadStore.write_over, tc.undo_failed_operation = real_write, real_undo
        moved = os.path.join(self.tmp, "elsewhere", "ws")
        os.makedirs(os.path.dirname(moved))
        os.rename(self.root, moved)
        os.symlink(moved, self.root, target_is_directory=True)
        later = tc.Checkpoints(tc.Config(watch=False, git=False))
        # The task is known by its old path; any call that takes the store's
        # lock finishes the rollback first, a new task's init among them.
        later.init(self.root, "again")
        self.assertEqual({name: read(moved, name) for name in names},
                         {name: b"unsaved work\n" for name in names})


if __name__ == "__main__":
    unittest.main()
