"""Edits another program makes while a restore or an import runs.

A restore or an import plans from a snapshot, secures the undo content and
writes its journal before it touches the workspace. Whatever writes a file
after that (an editor, a formatter, the agent's own shell) must not lose its
bytes: such a file is left as it is, reported in skipped_paths, and read by
the next scan. Here the other program writes right after the journal is on
disk, through the real Journal.begin, so the moment is always the same.
"""

import json
import os
import subprocess
import sys
import unittest

import support
from support import WorkspaceTest, sha

sys.path.insert(0, support.SCRIPTS)
import tc  # noqa: E402


class EditsWhileWriting(WorkspaceTest):

    def setUp(self):
        super().setUp()
        self.cp = tc.Checkpoints(tc.Config(watch=False, git=False))

    def edit_once_the_journal_is_written(self, edits):
        """edits: {rel: bytes, or None to delete} written right after the
        next journal's plan reaches the disk."""
        original = tc.Journal.begin

        def begin(journal, *args, **kwargs):
            result = original(journal, *args, **kwargs)
            tc.Journal.begin = original
            for rel, data in edits.items():
                if data is None:
                    os.remove(os.path.join(self.root, rel))
                else:
                    self.write(rel, data)
            return result

        tc.Journal.begin = begin
        self.addCleanup(setattr, tc.Journal, "begin", original)

    def fail_when_recording(self, first=None):
        """The restore's own record meets a full disk, once its files are
        written (and after first(), when given)."""
        original = tc.Checkpoints._record_drift

        def full_disk(cp, *args, **kwargs):
            if first is not None:
                first()
            raise OSError(28, "No space left on device")

        tc.Checkpoints._record_drift = full_disk
        self.addCleanup(setattr, tc.Checkpoints, "_record_drift", original)

    def failed_restore(self, first=None):
        """The error of a restore to step 1 whose record meets a full disk
        (see fail_when_recording)."""
        self.fail_when_recording(first=first)
        with self.assertRaises(tc.CheckpointError) as caught:
            self.cp.restore(self.root, index=1, apply=True)
        return str(caught.exception)

    def folder_then_file(self, inside, file_text=None):
        """Step 1 holds the file inside (x/inside.txt) and plain.txt; at
        step 2 inside's folder is gone, a file in its place when file_text
        is given, and plain.txt is longer."""
        folder = inside.rsplit("/", 1)[0]
        self.write(inside, "in the folder at step 1\n")
        self.write("plain.txt", "plain 1\n")
        self.cp.init(self.root, "shapes")
        self.cp.save(self.root, "one")
        os.remove(os.path.join(self.root, *inside.split("/")))
        os.rmdir(os.path.join(self.root, folder))
        if file_text is not None:
            self.write(folder, file_text)
        self.write("plain.txt", "plain 2, longer\n")
        self.cp.save(self.root, "two")

    def two_steps(self):
        """Step 1 and step 2 differ in replaced.txt, deleted.txt (only in
        step 2) and written.txt (only in step 1); plain.txt too."""
        self.write("replaced.txt", "replaced at step 1\n")
        self.write("written.txt", "only at step 1\n")
        self.write("plain.txt", "plain 1\n")
        self.cp.init(self.root, "edits")
        self.cp.save(self.root, "one")
        self.write("replaced.txt", "replaced at step 2, longer\n")
        os.remove(os.path.join(self.root, "written.txt"))
        self.write("deleted.txt", "only at step 2\n")
        self.write("plain.txt", "plain 2, longer\n")
        self.cp.save(self.root, "two")

    def step_files(self, index):
        shown = self.cp.show(self.root, index=index, limit=200)["steps"][0]["files"]
        return {f["path"]: f["sha256"] for f in shown}

    def test_a_restore_leaves_each_file_written_meanwhile_as_it_is(self):
        self.two_steps()
        self.write("replaced.txt", "unsaved edit before the restore\n")
        meanwhile = {"replaced.txt": b"written while the restore ran\n",
                     "deleted.txt": b"also written while the restore ran\n",
                     "written.txt": b"made while the restore ran\n"}
        self.edit_once_the_journal_is_written(meanwhile)
        res = self.cp.restore(self.root, index=1, apply=True)
        for rel, data in meanwhile.items():
            self.assertEqual(self.read(rel), data, rel)
        self.assertEqual(self.read("plain.txt"), b"plain 1\n")  # the rest is restored
        left = {item["path"]: item["reason"] for item in res["skipped_paths"]}
        self.assertEqual(sorted(left), sorted(meanwhile))
        self.assertIn("changed by something else while the restore ran", left["replaced.txt"])
        # The edit before the restore is in the recovered record, as ever.
        undo = self.cp.restore(self.root, drift_id=res["recovered"], apply=True)
        self.assertEqual(self.read("replaced.txt"), b"unsaved edit before the restore\n")
        # And what was written meanwhile is in the store: undoing the undo brings it back.
        self.cp.restore(self.root, drift_id=undo["recovered"], apply=True)
        self.assertEqual(self.read("replaced.txt"), meanwhile["replaced.txt"])

    def test_the_next_save_records_what_was_written_meanwhile(self):
        self.two_steps()
        self.edit_once_the_journal_is_written({"replaced.txt": b"meanwhile\n"})
        self.cp.restore(self.root, index=1, apply=True)
        index = self.cp.save(self.root, "three")["index"]
        files = self.step_files(index)
        self.assertEqual(files["replaced.txt"], sha(b"meanwhile\n"))
        self.assertEqual(files["plain.txt"], sha(b"plain 1\n"))

    def test_a_failed_restore_rolls_back_around_a_file_written_meanwhile(self):
        self.two_steps()
        self.edit_once_the_journal_is_written({"replaced.txt": b"meanwhile\n"})
        error = self.failed_restore()
        self.assertIn("nothing was changed", error)
        self.assertEqual(self.read("replaced.txt"), b"meanwhile\n")
        self.assertEqual(self.read("plain.txt"), b"plain 2, longer\n")
        self.assertEqual(self.read("deleted.txt"), b"only at step 2\n")

    def test_a_restores_own_work_on_hard_linked_names_is_not_taken_for_an_edit(self):
        # Removing or replacing one name of a file moves the ctime of its
        # other names: that is the restore's doing, not another program's.
        self.write("a.txt", "a at step 1\n")
        self.write("b.txt", "b at step 1\n")
        self.cp.init(self.root, "links")
        self.cp.save(self.root, "one")
        for rel in ("a.txt", "b.txt"):
            os.remove(os.path.join(self.root, rel))
        self.write("a.txt", "one file, three names, at step 2\n")
        for rel in ("b.txt", "c.txt"):
            os.link(os.path.join(self.root, "a.txt"), os.path.join(self.root, rel))
        self.cp.save(self.root, "two")
        res = self.cp.restore(self.root, index=1, apply=True)
        self.assertEqual(res["skipped_paths"], [])
        self.assertEqual(res["plan"]["to_delete"], ["c.txt"])
        self.assertEqual(self.read("a.txt"), b"a at step 1\n")
        self.assertEqual(self.read("b.txt"), b"b at step 1\n")
        self.assertFalse(os.path.exists(os.path.join(self.root, "c.txt")))

    def test_a_file_left_in_the_way_keeps_the_paths_it_blocks_out_too(self):
        # Step 1 has a folder x; now x is a file, which is written meanwhile:
        # x stays, so x/inside.txt cannot be written, and the rest goes on.
        self.folder_then_file("x/inside.txt", "a file now\n")
        self.edit_once_the_journal_is_written({"x": b"the file, written meanwhile\n"})
        res = self.cp.restore(self.root, index=1, apply=True)
        self.assertEqual(sorted(item["path"] for item in res["skipped_paths"]),
                         ["x", "x/inside.txt"])
        self.assertEqual(self.read("x"), b"the file, written meanwhile\n")
        self.assertEqual(self.read("plain.txt"), b"plain 1\n")

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
            "tc.Checkpoints._record_drift = lambda *args, **kwargs: os._exit(9)\n"
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

    def test_a_file_made_meanwhile_where_a_folder_must_go_is_left_with_it(self):
        self.folder_then_file("d/f.txt")
        self.edit_once_the_journal_is_written({"d": b"a file made meanwhile\n"})
        res = self.cp.restore(self.root, index=1, apply=True)
        self.assertEqual([item["path"] for item in res["skipped_paths"]], ["d/f.txt"])
        self.assertIn("stands where one of its folders must go", res["skipped_paths"][0]["reason"])
        self.assertEqual(self.read("d"), b"a file made meanwhile\n")
        self.assertEqual(self.read("plain.txt"), b"plain 1\n")

    def test_a_file_open_over_makes_passes_a_check_for_no_file(self):
        # Also where the workspace guard is off (Windows): open_over knows
        # whether it made the file, so "no file here" holds for one it made.
        dest = os.path.join(self.root, "new.txt")
        fh, _before = tc.open_over(dest, 0o644, expect=None)
        with fh:
            fh.write(b"new\n")
        self.assertEqual(self.read("new.txt"), b"new\n")
        gone = os.path.join(self.root, "gone.txt")
        with self.assertRaises(tc.ChangedMeanwhile):
            tc.open_over(gone, 0o644, expect=(4, 1))
        self.assertFalse(os.path.exists(gone), "the file made for the check stays")
        with self.assertRaises(tc.ChangedMeanwhile):
            tc.open_over(dest, 0o644, expect=None)
        self.assertEqual(self.read("new.txt"), b"new\n")

    def test_an_import_leaves_a_file_written_meanwhile_as_it_is(self):
        self.two_steps()
        out = os.path.join(self.tmp, "out")
        os.makedirs(out)
        package = self.cp.export(self.root, out)["path"]
        other = os.path.join(self.tmp, "other")
        os.makedirs(other)
        with open(os.path.join(other, "replaced.txt"), "wb") as fh:
            fh.write(b"here before the import\n")
        self.root, theirs = other, self.root
        self.edit_once_the_journal_is_written({"replaced.txt": b"written while it imported\n",
                                               "deleted.txt": b"made while it imported\n"})
        res = self.cp.import_package(other, package)
        self.assertEqual(self.read("replaced.txt"), b"written while it imported\n")
        self.assertEqual(self.read("deleted.txt"), b"made while it imported\n")
        self.assertEqual(self.read("plain.txt"), b"plain 2, longer\n")
        self.assertEqual(sorted(item["path"] for item in res["skipped_paths"]),
                         ["deleted.txt", "replaced.txt"])
        self.assertIsNone(res["recovered"])  # nothing here was overwritten
        resumed = self.cp.resume(other)
        self.assertEqual(sorted(resumed["drift_paths"]), ["deleted.txt", "replaced.txt"])
        self.root = theirs


if __name__ == "__main__":
    unittest.main()
