"""Diffs through a real server: tc_restore with diff: true (preview and
apply, from the workspace now to the target) and tc_show with index and
diff: true (what a step changed against the step before it).

A patch must be exactly what Python's difflib gives for the same two
contents; what has no patch says why; long patches and long diffs stay
within the result's size budget, and omitted.diff counts what was left out.
"""

import difflib
import json
import os
import sys

import support
from support import ToolsTest, snapshot

sys.path.insert(0, support.SCRIPTS)
import tc_mcp  # noqa: E402  (its RESULT_BUDGET)


def expected_patch(path, old, new):
    return "".join(difflib.unified_diff(old.splitlines(True), new.splitlines(True),
                                        "a/" + path, "b/" + path, n=3))


def counted(patch, sign):
    return sum(1 for line in patch.splitlines()[2:] if line.startswith(sign))


class DiffTest(ToolsTest):

    def by_path(self, entries):
        return {entry["path"]: entry for entry in entries}


class RestoreDiff(DiffTest):

    def test_patches_equal_difflib_and_a_preview_writes_nothing(self):
        step = {"keep.txt": "".join("line %d\n" % i for i in range(40)),
                "gone.txt": "only in the step\nsecond line\n",
                "same.txt": "unchanged\n"}
        self.init(name="diffs")
        for rel, text in step.items():
            self.write(rel, text)
        self.save("one")
        now = dict(step, **{"keep.txt": step["keep.txt"].replace("line 7\n", "line seven\n")
                            .replace("line 30\n", "") + "an added last line\n",
                            "new.txt": "made after the step\n"})
        del now["gone.txt"]
        os.remove(os.path.join(self.root, "gone.txt"))
        for rel, text in now.items():
            self.write(rel, text)
        before = snapshot(self.root)
        res = self.ok("tc_restore", root=self.root, index=1, diff=True)
        self.assertEqual(snapshot(self.root), before)
        entries = self.by_path(res["diff"])
        self.assertEqual(sorted(entries), ["gone.txt", "keep.txt", "new.txt"])
        self.assertEqual({p: e["change"] for p, e in entries.items()},
                         {"gone.txt": "write", "keep.txt": "replace", "new.txt": "delete"})
        for rel, entry in entries.items():
            with self.subTest(path=rel):
                patch = expected_patch(rel, now.get(rel, ""), step.get(rel, ""))
                self.assertEqual(entry["patch"], patch)
                self.assertEqual((entry["added"], entry["removed"]),
                                 (counted(patch, "+"), counted(patch, "-")))
                self.assertIsNone(entry["reason"])
        self.assertEqual((entries["keep.txt"]["added"], entries["keep.txt"]["removed"]), (2, 2))
        # An apply with diff gives the same diff, then writes.
        done = self.ok("tc_restore", root=self.root, index=1, diff=True, apply=True)
        self.assertEqual(done["diff"], res["diff"])
        self.assertEqual(self.read("keep.txt"), step["keep.txt"].encode())

    def test_what_has_no_patch_says_why(self):
        self.init(name="no patch")
        self.write("bin.dat", b"\x00\x01\x02 binary\n")
        self.write("latin.txt", "caf\xe9\n".encode("latin-1"))
        self.write("big.txt", b"x" * 100 + b"\n")
        self.write("run.sh", "#!/bin/sh\necho hi\n", mode=0o644)
        self.write("tail.txt", "no newline at the end")
        self.save("one")
        self.write("bin.dat", b"\x00\x01\x03 binary\n")
        self.write("latin.txt", "caf\xe8\n".encode("latin-1"))
        self.write("big.txt", b"y\n" * (600 * 1024))
        os.chmod(os.path.join(self.root, "run.sh"), 0o755)
        self.write("tail.txt", "no newline at the end, changed")
        entries = self.by_path(self.ok("tc_restore", root=self.root, index=1,
                                       diff=True)["diff"])
        for rel, reason in (("bin.dat", "binary"), ("latin.txt", "binary"),
                            ("big.txt", "over 1 MB")):
            with self.subTest(path=rel):
                self.assertIsNone(entries[rel]["patch"])
                self.assertEqual(entries[rel]["reason"], reason)
                self.assertIsNone(entries[rel]["added"])
        if support.keeps_mode_bits():
            self.assertEqual(entries["run.sh"]["patch"], "")
            self.assertEqual(entries["run.sh"]["reason"], "mode only: 755 -> 644")
            self.assertEqual((entries["run.sh"]["added"], entries["run.sh"]["removed"]), (0, 0))
        self.assertEqual(entries["tail.txt"]["patch"],
                         "--- a/tail.txt\n+++ b/tail.txt\n@@ -1 +1 @@\n"
                         "-no newline at the end, changed\n\\ No newline at end of file\n"
                         "+no newline at the end\n\\ No newline at end of file\n")

    def test_a_long_patch_is_cut_and_a_2000_file_diff_fits_the_budget(self):
        self.init(name="long")
        old = "".join("old line %d with some words in it\n" % i for i in range(1000))
        self.write("long.txt", old)
        for i in range(2000):
            self.write("many/f%04d.txt" % i, "file %d\nsecond line\n" % i)
        self.save("one")
        new = old.replace("old line", "new line")
        self.write("long.txt", new)
        for i in range(2000):
            self.write("many/f%04d.txt" % i, "file %d\nsecond line, changed\n" % i)
        res = self.ok("tc_restore", root=self.root, index=1, diff=True)
        size = len(json.dumps(res, ensure_ascii=False).encode("utf-8"))
        self.assertLessEqual(size, tc_mcp.RESULT_BUDGET)
        self.assertGreater(len(res["diff"]), 0)
        self.assertEqual(len(res["diff"]) + res["omitted"]["diff"], 2001)
        self.assertEqual(res["omitted"]["plan.to_replace"] + len(res["plan"]["to_replace"]),
                         2001)
        first = res["diff"][0]
        self.assertEqual(first["path"], "long.txt")
        lines = first["patch"].splitlines(True)
        self.assertLessEqual(len(lines), 401)
        full = expected_patch("long.txt", new, old)
        self.assertTrue(full.startswith("".join(lines[:-1])))
        left = len(full.splitlines()) - (len(lines) - 1)
        self.assertEqual(lines[-1], "\\ ... %d more lines of this patch left out\n" % left)
        self.assertEqual((first["added"], first["removed"]), (1000, 1000))

    def test_one_patch_larger_than_the_budget_is_cut_to_fit(self):
        self.init(name="wide")
        old = "".join("%04d %s\n" % (i, "o" * 400) for i in range(300))
        self.write("wide.txt", old)
        self.save("one")
        self.write("wide.txt", old.replace("o", "n"))
        res = self.ok("tc_restore", root=self.root, index=1, diff=True)
        self.assertLessEqual(len(json.dumps(res, ensure_ascii=False).encode("utf-8")),
                             tc_mcp.RESULT_BUDGET)
        patch = res["diff"][0]["patch"]
        self.assertRegex(patch.splitlines()[-1], r"^\\ \.\.\. \d+ more lines of this patch")
        self.assertEqual(res["diff"][0]["added"], 300)
        self.assertNotIn("diff", res["omitted"])


class ShowDiff(DiffTest):

    def test_what_each_step_changed(self):
        self.write("a.txt", "a at the start\n")
        self.write(".env", "TOKEN=1\n")
        self.init(name="show diff")
        self.write("a.txt", "a at step 1\n")
        self.write("b.txt", "b made at step 1\n")
        self.save("one")
        os.remove(os.path.join(self.root, "b.txt"))
        self.write(".env", "TOKEN=22\n")
        self.save("two")
        first = self.ok("tc_show", root=self.root, index=1, diff=True)["diff"]
        self.assertEqual([(e["path"], e["change"]) for e in first],
                         [("a.txt", "replace"), ("b.txt", "write")])
        self.assertEqual(first[0]["patch"],
                         expected_patch("a.txt", "a at the start\n", "a at step 1\n"))
        second = self.by_path(self.ok("tc_show", root=self.root, index=2, diff=True)["diff"])
        self.assertEqual(second["b.txt"]["change"], "delete")
        self.assertEqual(second["b.txt"]["patch"],
                         expected_patch("b.txt", "b made at step 1\n", ""))
        self.assertEqual((second[".env"]["patch"], second[".env"]["reason"]),
                         (None, "sensitive"))
        self.assertNotIn("diff", self.ok("tc_show", root=self.root, index=2))
        res = self.refused("tc_show", root=self.root, diff=True)
        self.assertIn("index", res.text)


if __name__ == "__main__":
    import unittest
    unittest.main()
