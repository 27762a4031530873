"""Saves, restores, exports and imports with files copied on several threads.

The number of work threads follows the machine (one on two cores), so these
tests set TC_WORK_THREADS to run the threaded paths on any machine and check
that the results are the very bytes and modes a single thread gives.
"""

import os
import random
import unittest

import support
from support import WorkspaceTest, snapshot, store_problems

THREADED = {"TC_WORK_THREADS": "4"}


def fill(root, rng, count, tag):
    """count files in nested folders, some executable, a few over 1 MB."""
    for i in range(count):
        size = rng.choice((40, 900, 20000, 70000)) if i % 25 else 1_200_000
        data = (("%s %d " % (tag, i)) * (size // 8 + 1)).encode()[:size]
        mode = 0o755 if i % 9 == 0 else 0o644
        support.write(root, "d%d/sub%d/f%03d.txt" % (i % 5, i % 3, i), data, mode)


class ThreadedPathsTest(WorkspaceTest):
    server_env = THREADED

    def test_restore_there_and_back_with_threads(self):
        rng = random.Random(7)
        fill(self.root, rng, 80, "one")
        srv = self.server()
        srv.ok("tc_init", root=self.root, name="threads")
        srv.ok("tc_save", root=self.root, title="one")
        first = snapshot(self.root)
        fill(self.root, rng, 80, "two")  # every file changes, mostly its size too
        os.remove(os.path.join(self.root, "d1", "sub1", "f001.txt"))
        srv.ok("tc_save", root=self.root, title="two")
        second = snapshot(self.root)

        res = srv.ok("tc_restore", root=self.root, index=1, apply=True)
        self.assertEqual(snapshot(self.root), first)
        srv.ok("tc_restore", root=self.root, drift_id=res["recovered"], apply=True)
        self.assertEqual(snapshot(self.root), second)
        self.assertEqual(store_problems(self.store), [])
        self.assertTrue(srv.ok("tc_resume", root=self.root)["health"]["ok"])

    def exported(self, seed, count):
        """A saved workspace of count files, exported: the package path."""
        fill(self.root, random.Random(seed), count, "pkg")
        srv = self.server()
        srv.ok("tc_init", root=self.root, name="threads handoff %d" % seed)
        srv.ok("tc_save", root=self.root, title="ready")
        out = os.path.join(self.tmp, "out")
        os.makedirs(out)
        return srv.ok("tc_export", root=self.root, to=out)["path"]

    def test_export_and_import_with_threads(self):
        package = self.exported(8, 70)
        target = os.path.join(self.tmp, "target")
        os.makedirs(target)
        other = self.server()
        other.ok("tc_import", root=target, package=package)
        self.assertEqual(snapshot(target), snapshot(self.root))
        self.assertEqual(store_problems(os.path.join(target, ".checkpoints")), [])
        resumed = other.ok("tc_resume", root=target)
        self.assertTrue(resumed["health"]["ok"], resumed["health"])
        self.assertEqual(resumed["drift_paths"], [])

    def test_a_file_that_fails_midway_undoes_the_whole_import(self):
        package = self.exported(9, 60)
        with open(os.path.join(package, "files", "d3", "sub1", "f043.txt"), "r+b") as fh:
            fh.write(b"TAMPERED")
        target = os.path.join(self.tmp, "target")
        support.write(target, "d0/sub0/f000.txt", b"already here\n")
        before = snapshot(target)
        res = self.server().call("tc_import", root=target, package=package)
        self.assertTrue(res.is_error, res)
        self.assertIn("does not match", res.text)
        self.assertEqual(snapshot(target), before)


if __name__ == "__main__":
    unittest.main()
