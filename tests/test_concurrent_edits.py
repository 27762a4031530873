"""Edits another program makes while a restore or an import runs.

A restore or an import plans from a snapshot, secures the undo content and
writes its journal before it touches the workspace. Whatever writes a file
after that (an editor, a formatter, the agent's own shell) must not lose its
bytes: such a file is left as it is, reported in skipped_paths, and read by
the next scan. Here the other program writes right after the journal is on
disk, through the real Journal.begin, so the moment is always the same.
"""

import os
import sys
import unittest

import support
from support import EditedMeanwhileTest, sha

sys.path.insert(0, support.SCRIPTS)
import tc  # noqa: E402


class EditsWhileWriting(EditedMeanwhileTest):

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
