"""The default save never misses a content change, whatever a tool did to the
file's timestamps.

Each case makes a same-size edit that leaves size and mtime exactly as the
index recorded them (os.utime with nanoseconds, `cp -p`, `touch -r`, a rename
over the file, an edit in the same clock tick as the save), then checks that
tc_save makes a new, non-idempotent step whose content restores byte for byte,
and, in a separate workspace, that tc_capture lists the file as modified.
It also checks the other side: the cache does work (nothing unchanged is read
again, nor what a restore or an import has just written).
"""

import hashlib
import os
import shutil
import subprocess
import sys
import unittest

from support import SCRIPTS, WorkspaceTest, drift_key, drift_paths

sys.path.insert(0, SCRIPTS)
import tc  # noqa: E402

ORIGINAL = b"original content: 0123456789abcdef\n"
EDITED = b"edited!! content: fedcba9876543210\n"
assert len(ORIGINAL) == len(EDITED)


class StatCacheTest(WorkspaceTest):

    server_env = {"TC_WATCH": "off", "TC_SHA_REUSE": None}

    def setUp(self):
        super().setUp()
        self.srv = self.server()
        self.outside = os.path.join(self.tmp, "outside")
        os.makedirs(self.outside)

    # -- helpers -----------------------------------------------------------

    def prepare(self, name):
        """A workspace with a saved, cache-warm target file; returns (root, stat)."""
        root = os.path.join(self.tmp, name)
        os.makedirs(os.path.join(root, "src"))
        with open(os.path.join(root, "src", "target.txt"), "wb") as fh:
            fh.write(ORIGINAL)
        with open(os.path.join(root, "other.txt"), "wb") as fh:
            fh.write(b"untouched\n")
        self.srv.ok("tc_init", root=root, name=name, goal="stat cache")
        first = self.srv.ok("tc_save", root=root, title="same title", conclusion="same")
        self.assertEqual(first["index"], 1)
        again = self.srv.ok("tc_save", root=root, title="same title", conclusion="same")
        self.assertTrue(again["idempotent"], "an unchanged save must be idempotent: %r" % again)
        return root, os.stat(os.path.join(root, "src", "target.txt"))

    def check_both(self, edit):
        """Run edit(root, path, stat) in two workspaces: one checked by save, one by capture."""
        root, st = self.prepare("by-save")
        path = os.path.join(root, "src", "target.txt")
        edit(root, path, st)
        self.assert_same_size_and_mtime(path, st)
        saved = self.srv.ok("tc_save", root=root, title="same title", conclusion="same")
        self.assertFalse(saved["idempotent"], "save missed the edit: %r" % saved)
        self.assertEqual(saved["index"], 2, saved)
        self.srv.ok("tc_restore", root=root, index=1, apply=True)
        with open(path, "rb") as fh:
            self.assertEqual(fh.read(), ORIGINAL)
        self.srv.ok("tc_restore", root=root, index=2, apply=True)
        with open(path, "rb") as fh:
            self.assertEqual(fh.read(), EDITED, "step 2 recorded stale content")

        root, st = self.prepare("by-capture")
        path = os.path.join(root, "src", "target.txt")
        edit(root, path, st)
        self.assert_same_size_and_mtime(path, st)
        cap = self.srv.ok("tc_capture", root=root)
        self.assertTrue(cap["captured"], "capture missed the edit: %r" % cap)
        shown = self.srv.ok("tc_show", root=root, include_drift=True, limit=200)
        records = [d for d in shown["drifts"] if drift_key(d) == cap["drift_id"]]
        self.assertEqual(len(records), 1, shown["drifts"])
        self.assertEqual(drift_paths(records[0], "modified"), ["src/target.txt"])
        self.assertEqual(drift_paths(records[0], "added"), [])
        self.assertEqual(drift_paths(records[0], "deleted"), [])
        # The drift holds the new bytes, not the indexed ones.
        with open(path, "wb") as fh:
            fh.write(b"x")
        self.srv.ok("tc_restore", root=root, drift_id=cap["drift_id"], apply=True)
        with open(path, "rb") as fh:
            self.assertEqual(fh.read(), EDITED)

    def assert_same_size_and_mtime(self, path, st):
        now = os.stat(path)
        self.assertEqual(now.st_size, st.st_size)
        self.assertEqual(now.st_mtime_ns, st.st_mtime_ns, "the edit did not put mtime back")
        with open(path, "rb") as fh:
            self.assertEqual(fh.read(), EDITED)

    def write_outside(self, name, data, mtime_ns):
        path = os.path.join(self.outside, name)
        with open(path, "wb") as fh:
            fh.write(data)
        os.utime(path, ns=(mtime_ns, mtime_ns))
        return path

    def make_tree(self, name, *, files, dirs):
        """A workspace of small files dN/fM.txt (file M in directory M % dirs)."""
        root = os.path.join(self.tmp, name)
        for number in range(files):
            path = os.path.join(root, "d%d" % (number % dirs), "f%d.txt" % number)
            os.makedirs(os.path.dirname(path), exist_ok=True)
            with open(path, "wb") as fh:
                fh.write(b"content %d\n" % number)
        return root

    # -- cases -------------------------------------------------------------

    @unittest.skipUnless(tc.STAT_CACHE_SUPPORTED, "needs the stat cache, which the server "
                                                 "keeps on POSIX only (on Windows every "
                                                 "scan reads every file)")
    def test_unchanged_files_are_not_read_again(self):
        """The cache must also work: a second look at an unchanged tree reads nothing."""
        root = self.make_tree("quiet", files=40, dirs=4)
        self.srv.ok("tc_init", root=root, name="quiet", goal="stat cache")
        self.srv.ok("tc_save", root=root, title="one")
        # Any file the save saw as racily clean is settled by this capture...
        self.srv.ok("tc_capture", root=root)
        # ...so this one reads no file at all, and an edit costs one read.
        self.assertEqual(self.srv.ok("tc_capture", root=root)["reads"], 0)
        with open(os.path.join(root, "d1", "f1.txt"), "ab") as fh:
            fh.write(b"more\n")
        cap = self.srv.ok("tc_capture", root=root)
        self.assertTrue(cap["captured"], cap)
        self.assertEqual(cap["reads"], 1, cap)

    @unittest.skipUnless(tc.STAT_CACHE_SUPPORTED, "needs the stat cache, which the server "
                                                 "keeps on POSIX only (on Windows every "
                                                 "scan reads every file)")
    def test_files_a_restore_or_an_import_made_are_not_read_back(self):
        root = self.make_tree("restored", files=150, dirs=5)
        self.srv.ok("tc_init", root=root, name="restored", goal="stat cache")
        self.srv.ok("tc_save", root=root, title="one")
        for number in range(150):
            with open(os.path.join(root, "d%d" % (number % 5), "f%d.txt" % number), "ab") as fh:
                fh.write(b"two\n")
        self.srv.ok("tc_save", root=root, title="two")
        for index in (1, 2):
            result = self.srv.ok("tc_restore", root=root, index=index, apply=True)
            replaced = len(result["plan"]["to_replace"])
            self.assertEqual(replaced + result["omitted"].get("plan.to_replace", 0), 150, result)
            # Written over in place and not flushed, each file is read once
            # more (a power cut could leave the old bytes under the new stat);
            # then the cache vouches for it again.
            self.assertEqual(self.srv.ok("tc_capture", root=root)["reads"], 150)
            self.assertLess(self.srv.ok("tc_capture", root=root)["reads"], 75)
        # Files a restore creates show a lost write in their size: the restore
        # knows what it wrote, and at most the files of its last clock tick
        # are left for the next look to read.
        shutil.rmtree(os.path.join(root, "d3"))
        shutil.rmtree(os.path.join(root, "d4"))
        self.srv.ok("tc_restore", root=root, index=2, apply=True)
        self.assertLess(self.srv.ok("tc_capture", root=root)["reads"], 30,
                        "capture read back what the restore made")
        out = os.path.join(self.tmp, "out")
        os.makedirs(out)
        package = self.srv.ok("tc_export", root=root, to=out)["path"]
        other = os.path.join(self.tmp, "imported")
        os.makedirs(other)
        self.srv.ok("tc_import", root=other, package=package)
        self.assertLess(self.srv.ok("tc_capture", root=other)["reads"], 75,
                        "capture read back what the import wrote")

        # Nothing written after a restore is missed, however soon and however
        # disguised (same size, mtime put back).
        path = os.path.join(root, "d1", "f1.txt")
        for round_no in range(4):
            self.srv.ok("tc_restore", root=root, index=1 + round_no % 2, apply=True)
            st = os.stat(path)
            with open(path, "r+b") as fh:
                fh.write(b"EDIT %d" % round_no)
            os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
            if round_no % 2:
                cap = self.srv.ok("tc_capture", root=root)
                self.assertEqual(cap["modified"], ["d1/f1.txt"], (round_no, cap))
            else:
                saved = self.srv.ok("tc_save", root=root, title="edit %d" % round_no)
                self.srv.ok("tc_restore", root=root, index=saved["index"], apply=True)
                with open(path, "rb") as fh:
                    self.assertTrue(fh.read().startswith(b"EDIT %d" % round_no), round_no)

    @unittest.skipUnless(tc.STAT_CACHE_SUPPORTED, "needs the stat cache, which the server "
                                                 "keeps on POSIX only (on Windows every "
                                                 "scan reads every file)")
    def test_rows_the_scan_before_a_restore_could_not_vouch_for_stay_unvouched(self):
        # The index a restore keeps is dated after its writes. A file the scan
        # before them saw with a time at or after that scan's stamp (changed
        # while it ran) must still be read next time, not trusted under the
        # later date; the restore's own files and older rows are kept as they are.
        store = tc.Store(os.path.join(self.tmp, "store"), lambda message: None)
        os.makedirs(store.directory)
        ws = tc.Workspace(self.tmp, store)
        scanned = 10**18
        sha = "ab" * 32
        rows = {"old.txt": tc.IndexRow(3, scanned - 5, scanned - 5, 11, 1, 0o644, "f", sha),
                "busy.txt": tc.IndexRow(3, scanned - 5, scanned + 5, 12, 1, 0o644, "f", sha),
                "written.txt": tc.IndexRow(3, scanned + 7, scanned + 7, 13, 1, 0o644, "f", sha)}
        before = tc.time.time_ns()
        index = tc.index_after_writes(ws, rows, {"written.txt"}, scanned)
        self.assertGreaterEqual(index["stamp_ns"], before - tc.RACY_MARGIN_NS)
        self.assertEqual(index["files"]["old.txt"], rows["old.txt"])
        self.assertEqual(index["files"]["written.txt"], rows["written.txt"])
        busy = index["files"]["busy.txt"]
        self.assertEqual(busy[:2] + busy[3:], rows["busy.txt"][:2] + rows["busy.txt"][3:])
        trusted = tc.Checkpoints(tc.Config(watch=False)).recorder.trust_test(index["stamp_ns"], True)
        info = tc.StatInfo(3, scanned - 5, scanned + 5, 12, 1, 0o644, False)
        self.assertFalse(trusted(busy, info), "a row changed during the scan became trusted")

    @unittest.skipUnless(tc.STAT_CACHE_SUPPORTED, "needs the stat cache, which the server "
                                                 "keeps on POSIX only (on Windows every "
                                                 "scan reads every file)")
    def test_index_changes_are_appended_and_read_back_by_a_new_server(self):
        root = self.make_tree("log", files=60, dirs=3)
        task = self.srv.ok("tc_init", root=root, name="log", goal="stat cache")["task_id"]
        task_dir = os.path.join(root, ".checkpoints", "tasks", task)
        self.srv.ok("tc_save", root=root, title="one")
        self.srv.ok("tc_capture", root=root)  # settles racily clean rows
        base = os.stat(os.path.join(task_dir, "index.json"))

        for number in (1, 2):
            with open(os.path.join(root, "d%d" % number, "f%d.txt" % number), "ab") as fh:
                fh.write(b"edit\n")
            cap = self.srv.ok("tc_capture", root=root)
            self.assertTrue(cap["captured"], cap)
            self.assertEqual(cap["modified"], ["d%d/f%d.txt" % (number, number)], cap)
            self.assertLessEqual(cap["reads"], 2, cap)
        after = os.stat(os.path.join(task_dir, "index.json"))
        self.assertEqual((after.st_ino, after.st_mtime_ns), (base.st_ino, base.st_mtime_ns),
                         "a small change rewrote the whole index")
        with open(os.path.join(task_dir, "index.log"), "rb") as fh:
            lines = fh.read().splitlines()
        self.assertGreaterEqual(len(lines), 2)
        self.assertTrue(any(b"d1/f1.txt" in line for line in lines), lines)

        self.srv.ok("tc_capture", root=root)  # settles the last edit's racy row
        # A new process rebuilds the same table from index.json + index.log.
        other = self.server()
        quiet = other.ok("tc_capture", root=root)
        self.assertEqual((quiet["captured"], quiet["reads"]), (False, 0), quiet)

        # A torn last line is ignored; what it would have said is found again.
        with open(os.path.join(task_dir, "index.log"), "ab") as fh:
            fh.write(b'{"gen": "torn", "set": {"d0/f0.t')
        with open(os.path.join(root, "d0", "f0.txt"), "ab") as fh:
            fh.write(b"edit\n")
        third = self.server()
        cap = third.ok("tc_capture", root=root)
        self.assertTrue(cap["captured"], cap)
        self.assertEqual((cap["added"], cap["modified"], cap["deleted"]),
                         ([], ["d0/f0.txt"], []), cap)
        self.assertEqual(third.ok("tc_capture", root=root)["reads"], 0)
        log = os.path.join(task_dir, "index.log")
        if os.path.exists(log):  # a damaged log is replaced by a whole index, never extended
            with open(log, "rb") as fh:
                self.assertNotIn(b"torn", fh.read(), "a damaged log was appended to")
        health = third.ok("tc_resume", root=root)["health"]
        self.assertTrue(health["ok"], health)

    def test_something_in_the_way_of_the_index_log_is_no_failure(self):
        root = os.path.join(self.tmp, "blocked")
        os.makedirs(root)
        with open(os.path.join(root, "a.txt"), "wb") as fh:
            fh.write(b"one\n")
        task = self.srv.ok("tc_init", root=root, name="blocked", goal="g")["task_id"]
        self.srv.ok("tc_save", root=root, title="one")
        os.makedirs(os.path.join(root, ".checkpoints", "tasks", task, "index.log", "x"))
        for number, data in enumerate((b"two\n", b"three\n"), start=2):
            with open(os.path.join(root, "a.txt"), "wb") as fh:
                fh.write(data)
            saved = self.srv.ok("tc_save", root=root, title="step %d" % number)
            self.assertEqual(saved["index"], number)
        self.srv.ok("tc_restore", root=root, index=2, apply=True)
        with open(os.path.join(root, "a.txt"), "rb") as fh:
            self.assertEqual(fh.read(), b"two\n")

    def test_mtime_put_back_with_os_utime(self):
        def edit(root, path, st):
            with open(path, "r+b") as fh:
                fh.write(EDITED)
            os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
        self.check_both(edit)

    @unittest.skipUnless(shutil.which("cp"), "needs the cp command")
    def test_cp_p_from_a_same_size_file(self):
        def edit(root, path, st):
            src = self.write_outside("src-%s" % os.path.basename(root), EDITED, st.st_mtime_ns)
            subprocess.run(["cp", "-p", src, path], check=True)
        self.check_both(edit)

    @unittest.skipUnless(shutil.which("touch"), "needs the touch command")
    def test_touch_r_from_a_reference_file(self):
        def edit(root, path, st):
            ref = self.write_outside("ref-%s" % os.path.basename(root), b"ref", st.st_mtime_ns)
            with open(path, "wb") as fh:
                fh.write(EDITED)
            subprocess.run(["touch", "-r", ref, path], check=True)
        self.check_both(edit)

    def test_file_replaced_by_rename_of_same_size_file(self):
        def edit(root, path, st):
            tmp = os.path.join(root, "src", ".target.txt.tmp")
            with open(tmp, "wb") as fh:
                fh.write(EDITED)
            os.utime(tmp, ns=(st.st_atime_ns, st.st_mtime_ns))
            os.rename(tmp, path)
        self.check_both(edit)

    def test_edit_in_the_same_clock_tick_right_after_a_save(self):
        # The file is written immediately before a save and rewritten immediately
        # after it, with mtime forced back; repeated so some rounds land in the
        # same timestamp tick as the save itself.
        root = os.path.join(self.tmp, "tick")
        os.makedirs(root)
        path = os.path.join(root, "f.txt")
        with open(path, "wb") as fh:
            fh.write(b"round 00\n")
        self.srv.ok("tc_init", root=root, name="tick", goal="g")
        self.srv.ok("tc_save", root=root, title="same", conclusion="same")
        expected = {1: b"round 00\n"}
        for n in range(1, 13):
            content = b"round %02d\n" % n
            with open(path, "wb") as fh:
                fh.write(content)
            st = os.stat(path)
            saved = self.srv.ok("tc_save", root=root, title="same", conclusion="same")
            self.assertFalse(saved["idempotent"], "round %d: %r" % (n, saved))
            expected[saved["index"]] = content
            # Same size, mtime put back, no pause: often the same clock tick.
            with open(path, "r+b") as fh:
                fh.write(b"ROUND %02d\n" % n)
            os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
            saved = self.srv.ok("tc_save", root=root, title="same", conclusion="same")
            self.assertFalse(saved["idempotent"], "round %d, edit after save: %r" % (n, saved))
            expected[saved["index"]] = b"ROUND %02d\n" % n
        self.assertEqual(sorted(expected), list(range(1, 26)))
        for index in (25, 2, 13, 1, 24):
            self.srv.ok("tc_restore", root=root, index=index, apply=True)
            with open(path, "rb") as fh:
                self.assertEqual(fh.read(), expected[index], "step %d" % index)

        # The same for capture: each same-tick edit shows up as modified.
        for n in range(3):
            self.srv.ok("tc_save", root=root, title="base %d" % n, conclusion="c")
            st = os.stat(path)
            with open(path, "r+b") as fh:
                fh.write(b"CAPT %02d\n" % n + b" " * (st.st_size - 8))
            os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
            cap = self.srv.ok("tc_capture", root=root)
            self.assertTrue(cap["captured"], "capture round %d: %r" % (n, cap))


class WrittenDuringARestoreTest(WorkspaceTest):
    """Another program writing a file while a restore writes it leaves bytes
    that are neither the stored content nor its own, under a stat taken after
    both. A file written in several writes is therefore read again by the
    next scan rather than trusted by that stat. Two core instances in one
    process, so that the other write lands at exactly that moment."""

    @unittest.skipUnless(tc.STAT_CACHE_SUPPORTED, "needs the stat cache, which the server "
                                                 "keeps on POSIX only (on Windows every "
                                                 "scan reads every file)")
    def test_the_next_scan_reads_a_large_restored_file_again(self):
        cp = tc.Checkpoints(tc.Config(watch=False, git=False))
        size = 3 << 20  # several writes
        self.write("big.bin", b"A" * size)
        self.write("small.txt", "one\n")
        cp.init(self.root, "concurrent")
        cp.save(self.root, "A")
        os.remove(os.path.join(self.root, "big.bin"))  # so the restore makes it anew
        self.write("new.txt", "two\n")
        cp.save(self.root, "B")
        real_end_over = tc.end_over

        def other_program_writes_first(fh, path, before, mode):
            if path.endswith("big.bin"):
                with open(path, "r+b") as other:
                    other.write(b"someone else")
            return real_end_over(fh, path, before, mode)

        tc.end_over = other_program_writes_first
        try:
            cp.restore(self.root, index=1, apply=True)
        finally:
            tc.end_over = real_end_over
        on_disk = self.read("big.bin")
        self.assertEqual(on_disk, b"someone else" + b"A" * (size - 12))
        captured = cp.capture(self.root)
        self.assertEqual((captured["modified"], captured["reads"]), (["big.bin"], 1))
        step = cp.save(self.root, "after")["index"]
        files = {f["path"]: f["sha256"] for f in cp.show(self.root, index=step)["steps"][0]["files"]}
        self.assertEqual(files["big.bin"], hashlib.sha256(on_disk).hexdigest())


if __name__ == "__main__":
    unittest.main()
