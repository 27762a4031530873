"""Other programs writing files while an operation runs.

A save reads files that an editor, a formatter or the agent's own shell may
be rewriting at that moment; a restore or an import writes files that they
may write too. A step holds only states a file really had. A file written
after a restore's or an import's journal reached the disk keeps the other
program's bytes: it is left as it is, reported in skipped_paths, and read by
the next scan. Where the moment matters the other program is a hook on the
real code path (here right after Journal.begin wrote the journal), so it is
always the same; elsewhere a thread races the real server.
"""

import os
import sys
import threading
import unittest

import support
from support import EditedMeanwhileTest, WorkspaceTest, sha

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


class ChangingWhileReadTest(WorkspaceTest):
    """A file rewritten while a save reads it: each step must hold a state
    the file really had, never the first part of one version joined to the
    rest of the next."""

    server_env = {"TC_WATCH": "off"}
    SIZE = 4 << 20

    def test_a_step_never_holds_a_mix_of_two_versions(self):
        path = os.path.join(self.root, "big.bin")
        with open(path, "wb") as fh:
            fh.write(b"A" * self.SIZE)
        srv = self.server()
        srv.ok("tc_init", root=self.root, name="torn")
        stop = threading.Event()

        def rewrite():
            letter = 0
            fd = os.open(path, os.O_WRONLY)
            try:
                while not stop.is_set():
                    block = bytes([ord("B") + letter % 20]) * (256 << 10)
                    for offset in range(0, self.SIZE, len(block)):
                        os.pwrite(fd, block, offset)
                    letter += 1
            finally:
                os.close(fd)

        writer = threading.Thread(target=rewrite)
        writer.start()
        try:
            steps = [srv.ok("tc_save", root=self.root, title="save %d" % number)["index"]
                     for number in range(8)]
        finally:
            stop.set()
            writer.join()
        for index in steps:
            srv.ok("tc_restore", root=self.root, index=index, apply=True)
            with open(path, "rb") as fh:
                data = fh.read()
            self.assertEqual(len(data), self.SIZE)
            self.assertEqual(data.count(data[:1]), self.SIZE,
                             "step %d holds a mix of versions: %r" % (index, sorted(set(data))))

    def test_a_file_appended_to_while_it_is_read_is_recorded(self):
        path = os.path.join(self.root, "train.log")
        with open(path, "wb") as fh:
            fh.write(b"warming up\n" * (self.SIZE // 11))
        srv = self.server()
        srv.ok("tc_init", root=self.root, name="log")
        stop = threading.Event()

        def append():
            number = 0
            with open(path, "ab", buffering=0) as fh:
                while not stop.is_set():
                    fh.write(b"epoch %d loss 0.%04d\n" % (number, number % 9973))
                    number += 1
                    stop.wait(0.001)

        writer = threading.Thread(target=append)
        writer.start()
        try:
            saves = [srv.ok("tc_save", root=self.root, title="save %d" % n) for n in range(4)]
        finally:
            stop.set()
            writer.join()
        with open(path, "rb") as fh:
            final = fh.read()
        for saved in saves:
            self.assertNotIn("train.log", [p["path"] for p in saved["skipped_paths"]], saved)
        for saved in saves:
            srv.ok("tc_restore", root=self.root, index=saved["index"], apply=True)
            with open(path, "rb") as fh:
                held = fh.read()
            self.assertGreaterEqual(len(held), self.SIZE // 11 * 11)
            self.assertTrue(final.startswith(held), "step %d is no state the log had"
                            % saved["index"])


if __name__ == "__main__":
    unittest.main()
