"""Handoff packages (tc_export / tc_import) through the real server.

A package is a directory `<task_id>-handoff/` with HANDOFF.md, a
machine-readable description (a JSON file at the top of the package) and the
files of the step. Crafted-package tests edit a copy of a real export.
"""

import hashlib
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import unittest

from support import (SCRIPTS, Server, WorkspaceTest, can_symlink, clean_env, file_bytes,
                     keeps_mode_bits, path_max, paths_of, read, sha, snapshot, store_holds,
                     tree_listing, write)

sys.path.insert(0, SCRIPTS)
import tc  # noqa: E402

NOISE = ("server.log",)


def note_of(store, package):
    """The note a store keeps of an export building package (as if one were)."""
    notes = os.path.join(store, "exporting")
    os.makedirs(notes, exist_ok=True)
    note = os.path.join(notes, os.path.basename(package) + ".json")
    with open(note, "w") as fh:
        json.dump({"tmp": package}, fh)
    return note


def workspace_state(root):
    """Every workspace file with bytes and mode, the store left out."""
    return snapshot(root, skip=(".checkpoints", ".git"))


def store_state(store):
    """A store's files with their bytes, plus its task directories.

    The log and lock files are left out: a refused call may log, and the lock
    file may be created by the first locked call.
    """
    if not os.path.isdir(store):
        return None
    files = {k: v[0] for k, v in snapshot(store, skip=()).items()
             if os.path.basename(k) not in NOISE and "lock" not in os.path.basename(k)}
    tasks = os.path.join(store, "tasks")
    return files, sorted(os.listdir(tasks)) if os.path.isdir(tasks) else []


def hashed_state(root):
    """{path: (sha256, mode)}: cheap to compare and to print."""
    return {k: (hashlib.sha256(v[0]).hexdigest()[:16], v[1])
            for k, v in workspace_state(root).items()}


def package_files(package):
    """Relative paths of every entry under a package (symlinks included)."""
    out = set()
    for dirpath, dirnames, filenames in os.walk(package):
        for name in filenames + [d for d in dirnames if os.path.islink(os.path.join(dirpath, d))]:
            out.add(os.path.relpath(os.path.join(dirpath, name), package).replace(os.sep, "/"))
    return out


def description_path(package):
    """The machine-readable description: the one JSON file at the package top."""
    names = sorted(n for n in os.listdir(package)
                   if n.endswith(".json") and os.path.isfile(os.path.join(package, n)))
    if len(names) != 1:
        raise AssertionError("expected one description JSON at the top of %s, found %r"
                             % (package, os.listdir(package)))
    return os.path.join(package, names[0])


def load_description(package):
    with open(description_path(package), "rb") as fh:
        return json.loads(fh.read().decode("utf-8"))


def save_description(package, data):
    with open(description_path(package), "wb") as fh:
        fh.write(json.dumps(data, indent=2).encode("utf-8"))


def file_entry_lists(data):
    """Every list of {path: ...} objects anywhere in the description."""
    found = []

    def walk(value):
        if isinstance(value, list):
            if value and all(isinstance(e, dict) and "path" in e for e in value):
                found.append(value)
            for item in value:
                walk(item)
        elif isinstance(value, dict):
            for item in value.values():
                walk(item)

    walk(data)
    return found


def replace_strings(value, old, new):
    if isinstance(value, str):
        return new if value == old else value
    if isinstance(value, list):
        return [replace_strings(v, old, new) for v in value]
    if isinstance(value, dict):
        return {k: replace_strings(v, old, new) for k, v in value.items()}
    return value


def content_copy(package, rel):
    """Where inside the package the content of workspace path rel is kept."""
    skip = {"HANDOFF.md", os.path.basename(description_path(package))}
    matches = [p for p in package_files(package)
               if p not in skip and (p == rel or p.endswith("/" + rel))]
    if len(matches) != 1:
        raise AssertionError("cannot find the copy of %r in package: %r"
                             % (rel, sorted(package_files(package))))
    return os.path.join(package, *matches[0].split("/"))


def make_package(directory, task_id, files, step=None):
    """A hand-made handoff package: files is [(path, bytes, mode)]."""
    pkg = os.path.join(directory, "%s-handoff" % task_id)
    entries = []
    for rel, data, mode in files:
        write(pkg, "files/" + rel, data)
        entries.append({"path": rel, "sha256": sha(data), "size": len(data), "mode": mode})
    desc = {"format": 1, "task": {"task_id": task_id, "name": "imported"}, "step": step,
            "files": entries, "filtered": [], "history": []}
    with open(os.path.join(pkg, "handoff.json"), "w", encoding="utf-8") as fh:
        json.dump(desc, fh)
    return pkg


class HandoffBase(WorkspaceTest):

    server_env = {"TC_WATCH": "off"}

    def make_source(self, srv, root=None):
        """Source files and a task with one step; returns (task_id, {path: bytes})."""
        return self.make_source_in(srv, root or self.root)

    @staticmethod
    def make_source_in(srv, root):
        files = {
            "README.md": b"# project\n",
            "src/app.py": b"print('hello')\r\n",
            "src/data.bin": bytes(range(256)) * 40,
            "docs/empty.txt": b"",
            "run.sh": b"#!/bin/sh\necho run\n",
        }
        for rel, data in files.items():
            path = os.path.join(root, *rel.split("/"))
            os.makedirs(os.path.dirname(path), exist_ok=True)
            with open(path, "wb") as fh:
                fh.write(data)
        os.chmod(os.path.join(root, "run.sh"), 0o755)
        init = srv.ok("tc_init", root=root, name="Port the parser",
                      goal="parser goal 4c1e", constraints="no new dependencies")
        srv.ok("tc_save", root=root, title="parser skeleton", conclusion="skeleton works",
               next="wire the CLI 9b7d", open_questions=["which flag name?"])
        return init["task_id"], files

    def export(self, srv, root=None, **extra):
        out = self.other_dir("tc-out-")
        res = srv.ok("tc_export", root=root or self.root, to=out, **extra)
        return res


class ExportImportTest(HandoffBase):

    def test_repeated_and_already_stored_content_is_imported_exactly(self):
        srv = self.server()
        files = {"a/one.txt": b"same bytes\n", "b/two.txt": b"same bytes\n",
                 "known.txt": b"the receiver has this already\n",
                 "big.bin": bytes(range(256)) * 9000, "empty.txt": b""}
        for rel, data in files.items():
            self.write(rel, data)
        srv.ok("tc_init", root=self.root, name="dupes")
        srv.ok("tc_save", root=self.root, title="one", conclusion="c", next="n")
        package = self.export(srv)["path"]
        target = os.path.join(self.other_dir(), "ws")
        os.makedirs(target)
        with open(os.path.join(target, "mine.txt"), "wb") as fh:
            fh.write(files["known.txt"])
        srv.ok("tc_import", root=target, package=package)
        got = file_bytes(target)
        for rel, data in files.items():
            self.assertEqual(got[rel], data, rel)
        self.assertEqual(got["mine.txt"], files["known.txt"])
        with open(os.path.join(target, "a", "one.txt"), "wb") as fh:
            fh.write(b"changed after the import\n")
        srv.ok("tc_restore", root=target, index=1, apply=True)
        self.assertEqual(file_bytes(target)["a/one.txt"], files["a/one.txt"])

    def test_a_tampered_copy_of_repeated_content_is_refused(self):
        srv = self.server()
        for rel in ("a/one.txt", "b/two.txt", "c/three.txt"):
            self.write(rel, b"same bytes in three places\n")
        srv.ok("tc_init", root=self.root, name="dupes")
        srv.ok("tc_save", root=self.root, title="one", conclusion="c", next="n")
        package = self.export(srv)["path"]
        with open(content_copy(package, "c/three.txt"), "r+b") as fh:
            fh.write(b"EVIL")
        target = os.path.join(self.other_dir(), "ws")
        os.makedirs(target)
        res = srv.call("tc_import", root=target, package=package)
        self.assertTrue(res.is_error, res)
        self.assertIn("does not match its recorded hash", res.text)
        self.assertEqual(file_bytes(target), {})

    def test_round_trip_reproduces_step_and_resumes(self):
        src = self.server()
        self.write(".env", "SECRET=hunter2-xyz\n")
        self.write("deploy/prod_credentials.json", '{"password": "hunter2-xyz"}')
        self.write("keys/id_rsa", "-----BEGIN hunter2-xyz-----\n")
        task_id, files = self.make_source(src)
        sensitive = {".env", "deploy/prod_credentials.json", "keys/id_rsa"}
        out = self.other_dir("tc-out-")
        res = src.ok("tc_export", root=self.root, to=out)
        package = os.path.join(out, task_id + "-handoff")
        self.assertEqual(res["path"], package)
        self.assertTrue(os.path.isdir(package))
        self.assertEqual(paths_of(res["files"]), set(files))
        self.assertTrue(sensitive <= paths_of(res["filtered"]), res["filtered"])
        for rel in package_files(package):
            self.assertNotIn(os.path.basename(rel), {".env", "prod_credentials.json", "id_rsa"})
            path = os.path.join(package, rel)
            if os.path.isfile(path):
                with open(path, "rb") as fh:
                    self.assertNotIn(b"hunter2-xyz", fh.read(), rel)

        with open(os.path.join(package, "HANDOFF.md"), encoding="utf-8") as fh:
            handoff = fh.read()
        for text in ("Port the parser", "parser goal 4c1e", "wire the CLI 9b7d"):
            self.assertIn(text, handoff)
        load_description(package)  # parses

        target = os.path.join(self.other_dir(), "ws")
        os.makedirs(target)
        dst = self.server(cwd=os.path.dirname(target))
        imported = dst.ok("tc_import", root=target, package=package)
        self.assertEqual(imported["task_id"], task_id)
        self.assertEqual(file_bytes(target), files)
        if keeps_mode_bits():  # Windows has no executable bit to keep
            self.assertTrue(os.stat(os.path.join(target, "run.sh")).st_mode & 0o100,
                            "executable bit lost on import")

        here = src.ok("tc_resume", root=self.root)
        there = dst.ok("tc_resume", root=target)
        for key in ("goal", "head", "next"):
            self.assertEqual(there[key], here[key], key)
        self.assertIn("wire the CLI 9b7d", there["handoff"])
        # The imported step is restorable on the receiving side.
        with open(os.path.join(target, "src", "app.py"), "wb") as fh:
            fh.write(b"local edit\n")
        dst.ok("tc_restore", root=target, index=there["head"], apply=True)
        self.assertEqual(file_bytes(target), files)

    def test_steps_numbered_after_the_exported_head_are_not_reused(self):
        src = self.server()
        src.ok("tc_init", root=self.root, name="numbering")
        self.write("notes.txt", "start\n")
        for number in (1, 2, 3):
            self.write("notes.txt", "draft %d\n" % number)
            self.assertEqual(src.ok("tc_save", root=self.root, title="step %d" % number)["index"],
                             number)
        src.ok("tc_restore", root=self.root, index=1, apply=True)
        out = self.other_dir("tc-out-")
        package = src.ok("tc_export", root=self.root, to=out)["path"]
        target = os.path.join(self.other_dir(), "ws")
        os.makedirs(target)
        dst = self.server(cwd=os.path.dirname(target))
        dst.ok("tc_import", root=target, package=package)
        self.assertEqual(dst.ok("tc_resume", root=target)["head"], 1)
        write(target, "notes.txt", "received\n")
        # Steps 2 and 3 exist at the sender: the receiver's next step is 4, as the sender's is.
        self.assertEqual(dst.ok("tc_save", root=target, title="there")["index"], 4)
        self.assertEqual(src.ok("tc_save", root=self.root, title="here")["index"], 4)
        missing = dst.call("tc_restore", root=target, index=2)
        self.assertTrue(missing.is_error, missing)
        self.assertNotIn("Traceback", missing.text)

    def test_export_names_the_changes_the_package_lacks(self):
        srv = self.server()
        _task, files = self.make_source(srv)
        clean = self.export(srv)
        self.assertEqual(clean["changed_since_step"], [])
        with open(os.path.join(clean["path"], "HANDOFF.md"), encoding="utf-8") as fh:
            self.assertNotIn("not in this package", fh.read())
        self.write("src/app.py", "print('edited, then captured')\n")
        srv.ok("tc_capture", root=self.root)
        self.write("src/new.py", "x = 1\n")
        res = self.export(srv)
        self.assertEqual(res["changed_since_step"], ["src/app.py", "src/new.py"])
        self.assertEqual(paths_of(res["files"]), set(files))
        with open(content_copy(res["path"], "src/app.py"), "rb") as fh:
            self.assertEqual(fh.read(), files["src/app.py"], "the package holds the step")
        with open(os.path.join(res["path"], "HANDOFF.md"), encoding="utf-8") as fh:
            handoff = fh.read()
        self.assertIn("so not in this package (2;", handoff)
        self.assertIn("- `src/app.py`\n- `src/new.py`\n", handoff)

    def test_a_task_with_no_step_exports_its_latest_record(self):
        # After a restore that left a file as it was, or an import of a
        # package with no step, the latest record is known to the index
        # alone; the package must still hold it.
        srv = self.server()
        self.write("a.txt", "zero\n")
        self.write(".env", "K=1\n")
        srv.ok("tc_init", root=self.root, name="no step yet")
        self.write("a.txt", "one\n")
        self.write(".env", "K=22\n")
        srv.ok("tc_capture", root=self.root)
        restored = srv.ok("tc_restore", root=self.root, drift_id="d0001", apply=True)
        self.assertEqual(restored["plan"]["unrestorable"][0]["path"], ".env")
        res = self.export(srv)
        self.assertEqual((paths_of(res["files"]), res["changed_since_step"]), ({"a.txt"}, []))
        with open(content_copy(res["path"], "a.txt"), "rb") as fh:
            self.assertEqual(fh.read(), b"zero\n")
        other = os.path.join(self.other_dir(), "ws")
        os.makedirs(other)
        srv.ok("tc_import", root=other, package=res["path"])
        again = self.export(srv, root=other)
        self.assertEqual((paths_of(again["files"]), again["changed_since_step"]),
                         ({"a.txt"}, []))

    def test_export_destination_must_be_an_existing_absolute_directory(self):
        srv = self.server(cwd=self.tmp)
        self.make_source(srv)
        a_file = os.path.join(self.tmp, "plain-file")
        with open(a_file, "wb") as fh:
            fh.write(b"x")
        before = tree_listing(self.tmp)
        for to in ("relative-out", os.path.join(self.tmp, "missing"), a_file, ""):
            res = srv.call("tc_export", root=self.root, to=to)
            self.assertTrue(res.is_error, (to, res))
            self.assertNotIn("Traceback", res.text)
        after = tree_listing(self.tmp)
        self.assertEqual([p for p in after if ".checkpoints" not in p[0]],
                         [p for p in before if ".checkpoints" not in p[0]])
        self.assertFalse(os.path.exists(os.path.join(tempfile.gettempdir(), "relative-out")))

    def test_a_destination_inside_the_workspace_or_its_store_is_refused(self):
        srv = self.server(cwd=self.tmp)
        self.make_source(srv)
        inside = os.path.join(self.root, "exports")
        os.makedirs(inside)
        before = tree_listing(self.root)
        for to in (self.root, inside, os.path.join(self.root, ".checkpoints")):
            res = srv.call("tc_export", root=self.root, to=to)
            self.assertTrue(res.is_error, (to, res))
            self.assertIn("outside", res.text)
        self.assertEqual([p for p in tree_listing(self.root) if ".checkpoints" not in p[0]],
                         [p for p in before if ".checkpoints" not in p[0]])

    def test_existing_package_of_same_name_is_refused(self):
        srv = self.server()
        task_id, _ = self.make_source(srv)
        res = self.export(srv)
        package = res["path"]
        listing = tree_listing(package)
        with open(os.path.join(package, "HANDOFF.md"), "rb") as fh:
            handoff = fh.read()
        self.write("README.md", "# changed after the first export\n")
        srv.ok("tc_save", root=self.root, title="second", conclusion="c", next="n")
        again = srv.call("tc_export", root=self.root, to=os.path.dirname(package))
        self.assertTrue(again.is_error, again)
        self.assertEqual(tree_listing(package), listing)
        with open(os.path.join(package, "HANDOFF.md"), "rb") as fh:
            self.assertEqual(fh.read(), handoff)
        self.assertEqual(sorted(os.listdir(os.path.dirname(package))),
                         [os.path.basename(package)])

    def test_history_export_restores_every_step_on_the_receiving_side(self):
        srv = self.server()
        task_id, _ = self.make_source(srv)
        states = {1: file_bytes(self.root)}
        self.write("src/app.py", "print('step two')\n")
        self.write("src/new.py", "x = 2\n")
        os.remove(os.path.join(self.root, "docs", "empty.txt"))
        self.assertEqual(srv.ok("tc_save", root=self.root, title="two", conclusion="c",
                                next="n2")["index"], 2)
        states[2] = file_bytes(self.root)
        self.write("src/data.bin", bytes(range(255, -1, -1)) * 50)
        os.remove(os.path.join(self.root, "src", "new.py"))
        self.write("docs/guide.md", "guide\n")
        self.assertEqual(srv.ok("tc_save", root=self.root, title="three", conclusion="c",
                                next="n3")["index"], 3)
        states[3] = file_bytes(self.root)

        res = self.export(srv, history=True)
        target = os.path.join(self.other_dir(), "ws")
        os.makedirs(target)
        dst = self.server()
        dst.ok("tc_import", root=target, package=res["path"])
        self.assertEqual(file_bytes(target), states[3])
        shown = dst.ok("tc_show", root=target)
        self.assertEqual(sorted(s["index"] for s in shown["steps"]), [1, 2, 3])
        for index in (1, 2, 3, 1):
            dst.ok("tc_restore", root=target, index=index, apply=True)
            self.assertEqual(file_bytes(target), states[index], "step %d" % index)


class NewerSensitiveListTest(HandoffBase):
    """Steps recorded while the sensitive list did not take a name (an
    older version) hold its content; an export made now leaves it out, as
    every workspace now refuses a package that would write it."""

    def test_a_file_sensitive_by_the_list_of_now_is_filtered_from_the_package(self):
        classify = tc.PathPolicy._classify_file
        tc.PathPolicy._classify_file = staticmethod(
            lambda low: False if low == "credentials.md" else classify(low))
        self.addCleanup(setattr, tc.PathPolicy, "_classify_file", staticmethod(classify))
        self.write("credentials.md", "how to rotate the keys\n")
        self.write("main.py", "print(1)\n")
        cp = tc.Checkpoints(tc.Config(watch=False, git=False))
        cp.init(self.root, "older list")
        cp.save(self.root, "one")
        tc.PathPolicy._classify_file = staticmethod(classify)
        cp = tc.Checkpoints(tc.Config(watch=False, git=False))  # a server of this version
        for history in (False, True):
            out = self.other_dir("tc-out-")
            exported = cp.export(self.root, out, history=history)
            self.assertIn({"path": "credentials.md", "reason": "sensitive"},
                          exported["filtered"])
            self.assertNotIn("credentials.md", exported["files"])
            for _dir, _dirs, names in os.walk(exported["path"]):
                for name in names:
                    with open(os.path.join(_dir, name), "rb") as fh:
                        self.assertNotIn(b"rotate the keys", fh.read(), name)
            other = self.other_dir("tc-in-")
            cp.import_package(other, exported["path"])
            self.assertEqual(read(other, "main.py"), b"print(1)\n")
            self.assertFalse(os.path.exists(os.path.join(other, "credentials.md")))


class LeftOutFilesAcrossTest(HandoffBase):
    """What the sender's steps hold of a sensitive file (its size, no
    content) does not cross: the receiver's steps do not list it, so it
    never reads as changed there for being absent."""

    def test_a_sensitive_file_of_the_sender_is_not_changed_on_the_receiver(self):
        self.write("main.py", "x = 1\n")
        self.write("deploy/id_rsa", "PRIVATE\n")
        cp = tc.Checkpoints(tc.Config(watch=False, git=False))
        cp.init(self.root, "left out")
        cp.save(self.root, "one")
        self.write("main.py", "x = 2\n")
        cp.save(self.root, "two")
        for history in (False, True):
            exported = cp.export(self.root, self.other_dir("tc-out-"), history=history)
            other = self.other_dir("tc-in-")
            cp.import_package(other, exported["path"])
            resumed = cp.resume(other)
            self.assertEqual(resumed["changed_since_step"], [], history)
            self.assertNotIn("id_rsa", resumed["handoff"], history)
            self.assertEqual(read(other, "main.py"), b"x = 2\n")
        # With history, the sender's first step restores here, deleting nothing.
        self.assertEqual(cp.restore(other, index=1, apply=True)["plan"]["to_delete"], [])
        self.assertEqual(read(other, "main.py"), b"x = 1\n")


class LongPathTest(HandoffBase):

    def test_a_path_too_long_for_the_package_is_filtered_not_fatal(self):
        limit = path_max()
        if not limit or limit > 8192:
            self.skipTest("needs a known PATH_MAX")
        srv = self.server()
        self.write("a.txt", "short\n")
        # A file whose path fits under the workspace, not under the package's folder.
        folder = os.path.join(self.root, "long")
        while len(folder) < limit - 400:
            folder = os.path.join(folder, "L" * 200)
        name = "f" * (limit - 2 - len(folder) - 1)
        write(folder, name, "long path\n")
        rel = os.path.relpath(os.path.join(folder, name), self.root).replace(os.sep, "/")
        srv.ok("tc_init", root=self.root, name="long")
        srv.ok("tc_save", root=self.root, title="one")
        res = self.export(srv)
        self.assertEqual([item["path"] for item in res["filtered"]], [rel])
        self.assertTrue(os.path.isfile(os.path.join(res["path"], "files", "a.txt")))


class LostContentTest(HandoffBase):

    def test_history_with_content_already_lost_still_imports(self):
        """A step whose stored content was lost at the source travels anyway;
        only that content is unrestorable on the receiving side, as at home."""
        srv = self.server()
        self.make_source(srv)
        self.write("src/app.py", "print('step two')\n")
        srv.ok("tc_save", root=self.root, title="two", conclusion="c", next="n2")
        old_sha = hashlib.sha256(b"print('hello')\r\n").hexdigest()
        os.remove(os.path.join(self.store, "payload", old_sha[:2], old_sha))
        res = self.export(srv, history=True)
        target = os.path.join(self.other_dir(), "ws")
        os.makedirs(target)
        dst = self.server()
        dst.ok("tc_import", root=target, package=res["path"])
        plan = dst.ok("tc_restore", root=target, index=1)["plan"]
        self.assertEqual([u["path"] for u in plan["unrestorable"]], ["src/app.py"])
        self.assertIn("README.md", json.dumps(dst.ok("tc_show", root=target, index=1)))


class CraftedPackageTest(HandoffBase):
    """Every malformed package is refused before anything is written."""

    @classmethod
    def setUpClass(cls):
        """One real source task and two real exports, shared read-only by the tests:
        `package` (step 1 only) and `history_source` (steps 1 and 2, history:true)."""
        cls.shared = os.path.realpath(tempfile.mkdtemp(prefix="tc-crafted-src-"))
        root = os.path.join(cls.shared, "ws")
        os.makedirs(root)
        src = Server(env=dict(cls.server_env))
        try:
            src.initialize()
            cls.task_id, cls.files = cls.make_source_in(src, root)
            out = os.path.join(cls.shared, "out")
            os.makedirs(out)
            cls.package = src.ok("tc_export", root=root, to=out)["path"]
            with open(os.path.join(root, "src", "app.py"), "wb") as fh:
                fh.write(b"print('step two')\n")
            src.ok("tc_save", root=root, title="two", conclusion="c", next="n")
            out = os.path.join(cls.shared, "out-history")
            os.makedirs(out)
            cls.history_source = src.ok("tc_export", root=root, to=out, history=True)["path"]
        except BaseException:
            shutil.rmtree(cls.shared, ignore_errors=True)
            raise
        finally:
            src.close()

    @classmethod
    def tearDownClass(cls):
        shutil.rmtree(cls.shared, ignore_errors=True)

    def setUp(self):
        super().setUp()
        self.crafts = self.other_dir("tc-crafts-")
        self.target_parent = self.other_dir("tc-target-")
        self.target = os.path.join(self.target_parent, "ws")
        os.makedirs(self.target)
        with open(os.path.join(self.target, "mine.txt"), "wb") as fh:
            fh.write(b"the receiver's own work\n")
        with open(os.path.join(self.target, "README.md"), "wb") as fh:
            fh.write(b"receiver readme, must survive\n")
        self.dst = self.server()
        self.dst.ok("tc_init", root=self.target, name="receiver", goal="own goal")
        self.dst.ok("tc_save", root=self.target, title="own step", conclusion="c", next="n")
        self._n = 0

    def copy_package(self):
        self._n += 1
        dst = os.path.join(self.crafts, str(self._n), os.path.basename(self.package))
        shutil.copytree(self.package, dst, symlinks=True)
        return dst

    def assert_refused_without_trace(self, package, why):
        ws = workspace_state(self.target)
        store = store_state(os.path.join(self.target, ".checkpoints"))
        parent = tree_listing(self.target_parent)
        resume = self.dst.ok("tc_resume", root=self.target)
        res = self.dst.call("tc_import", root=self.target, package=package)
        self.assertTrue(res.is_error, "%s: import accepted: %r" % (why, res))
        self.assertNotIn("Traceback", res.text)
        self.assertEqual(workspace_state(self.target), ws, why)
        self.assertEqual(store_state(os.path.join(self.target, ".checkpoints")), store, why)
        outside_store = lambda listing: sorted(
            p for p in listing if not p[0].startswith(os.path.join("ws", ".checkpoints")))
        self.assertEqual(outside_store(tree_listing(self.target_parent)), outside_store(parent),
                         why)
        after = self.dst.ok("tc_resume", root=self.target)
        self.assertEqual(after["goal"], resume["goal"], why)
        self.assertEqual(after["active_task"], resume["active_task"], why)
        return res

    def edit_first_entry(self, package, new_path):
        data = load_description(package)
        lists = file_entry_lists(data)
        self.assertTrue(lists, "no file list with 'path' entries in %r" % data)
        entry = next(e for e in lists[0] if e["path"] == "src/app.py")
        for entries in lists:
            for e in entries:
                if e["path"] == "src/app.py":
                    e["path"] = new_path
        save_description(package, data)
        return entry

    def test_dotdot_entry_is_refused(self):
        package = self.copy_package()
        copy = content_copy(package, "src/app.py")
        base = copy[: -len("src/app.py")]
        self.edit_first_entry(package, "../escape.txt")
        # Make the crafted entry self-consistent: its content exists where the
        # path points, so only the path check can stop it.
        escape_src = os.path.normpath(os.path.join(base, "../escape.txt"))
        if escape_src.startswith(self.crafts):
            shutil.copyfile(copy, escape_src)
        self.assert_refused_without_trace(package, "'..' entry")
        self.assertFalse(os.path.exists(os.path.join(self.target_parent, "escape.txt")))

    def test_absolute_path_entry_is_refused(self):
        package = self.copy_package()
        victim = os.path.join(self.target_parent, "abs-victim", "escape.txt")
        self.edit_first_entry(package, victim)
        self.assert_refused_without_trace(package, "absolute entry")
        self.assertFalse(os.path.exists(victim))

    @unittest.skipUnless(can_symlink(), "needs the right to make symlinks")
    def test_symlink_entry_is_refused(self):
        package = self.copy_package()
        copy = content_copy(package, "src/app.py")
        outside = os.path.join(self.crafts, "outside-app.py")
        shutil.copyfile(copy, outside)  # same bytes: the hash still matches
        os.remove(copy)
        os.symlink(outside, copy)
        self.assert_refused_without_trace(package, "symlink entry")
        self.assertFalse(os.path.islink(os.path.join(self.target, "src", "app.py")))

    def test_tampered_file_is_refused(self):
        package = self.copy_package()
        copy = content_copy(package, "src/data.bin")
        with open(copy, "r+b") as fh:
            fh.seek(100)
            fh.write(b"\x00TAMPERED\x00")
        self.assert_refused_without_trace(package, "tampered file")

    def test_a_refused_import_into_a_workspace_without_a_store_leaves_it_as_it_was(self):
        fresh = os.path.join(self.target_parent, "fresh")
        write(fresh, "mine.txt", "the receiver's own work\n")
        tampered = self.copy_package()
        with open(content_copy(tampered, "src/data.bin"), "r+b") as fh:
            fh.seek(100)
            fh.write(b"\x00TAMPERED\x00")
        linked = os.path.join(self.target_parent, "linked")
        write(linked, "mine.txt", "mine\n")
        outside = os.path.join(self.target_parent, "outside")
        write(outside, "app.py", "elsewhere\n")
        if can_symlink():
            os.symlink(outside, os.path.join(linked, "src"))
        for target, package in ((fresh, tampered), (linked, self.copy_package())):
            if target == linked and not can_symlink():
                continue
            before = tree_listing(target)
            res = self.dst.call("tc_import", root=target, package=package)
            self.assertTrue(res.is_error, res)
            self.assertEqual(tree_listing(target), before, "%s: no store is left" % target)
        self.assertEqual(read(outside, "app.py"), b"elsewhere\n")

    def test_tampered_file_whose_content_the_receiver_holds_is_refused(self):
        # The receiving store already holds src/app.py's content, so the
        # import writes that file from the package, checking it on the way.
        with open(os.path.join(self.target, "same-as-app.py"), "wb") as fh:
            fh.write(self.files["src/app.py"])
        self.dst.ok("tc_save", root=self.target, title="holds the content", conclusion="c",
                    next="n")
        package = self.copy_package()
        copy = content_copy(package, "src/app.py")
        with open(copy, "r+b") as fh:
            fh.write(b"PRINT")
        self.assert_refused_without_trace(package, "tampered file with known content")

    def test_task_that_already_exists_is_refused(self):
        package = self.copy_package()
        first = self.dst.ok("tc_import", root=self.target, package=package)
        self.assertEqual(first["task_id"], self.task_id)
        self.assertEqual(file_bytes(self.target)["src/app.py"], self.files["src/app.py"])
        self.assert_refused_without_trace(package, "duplicate task")

    def test_task_id_with_a_slash_is_refused(self):
        for bad in ("evil/slash", "../evil", "a\\b", "a..b", "task.lock", "task."):
            package = self.copy_package()
            data = replace_strings(load_description(package), self.task_id, bad)
            self.assertNotEqual(data, load_description(package), "task id not in description")
            save_description(package, data)
            self.assert_refused_without_trace(package, "task id %r" % bad)
            store = os.path.join(self.target, ".checkpoints")
            self.assertFalse(os.path.exists(os.path.join(store, "tasks", "evil")))
            self.assertFalse(os.path.exists(os.path.join(store, "evil")))

    def test_a_step_number_beyond_nine_digits_is_refused(self):
        for number in (10 ** 9, 2 ** 63, 10 ** 200):
            package = self.copy_package()
            data = load_description(package)
            self.assertEqual(data["step"]["index"], 1)
            data["step"]["index"] = number
            save_description(package, data)
            self.assert_refused_without_trace(package, "step %d" % number)

    def test_a_last_step_number_that_is_not_one_is_refused(self):
        for bad in (-1, 10 ** 9, "3", 2.5, True):
            package = self.copy_package()
            data = load_description(package)
            data["task"]["last_step"] = bad
            save_description(package, data)
            self.assert_refused_without_trace(package, "last step %r" % (bad,))
        res = self.dst.call("tc_import", root=self.target, package=package)
        self.assertIn("(got True)", res.text)

    def import_at_the_highest_step_number(self):
        """(task id, package description) of an imported task whose sender
        numbered steps up to the highest number a step can have."""
        package = self.copy_package()
        data = load_description(package)
        data["task"]["last_step"] = 999_999_999
        save_description(package, data)
        return self.dst.ok("tc_import", root=self.target, package=package)["task_id"], data

    def test_a_task_at_the_highest_step_number_refuses_the_next_save(self):
        task_id, data = self.import_at_the_highest_step_number()
        steps = os.path.join(self.target, ".checkpoints", "tasks", task_id, "steps")
        before = sorted(os.listdir(steps))
        write(self.target, "more.txt", "more\n")
        drifts = os.path.join(self.target, ".checkpoints", "tasks", task_id, "drifts")
        drifts_before = sorted(os.listdir(drifts))
        res = self.dst.call("tc_save", root=self.target, title="one more")
        self.assertTrue(res.is_error, res)
        self.assertIn("highest number", res.text)
        self.assertEqual(sorted(os.listdir(steps)), before)
        self.assertEqual(sorted(os.listdir(drifts)), drifts_before)
        self.assertTrue(self.dst.ok("tc_resume", root=self.target)["health"]["ok"])
        # It can still be closed, with any title: no new step, and what
        # changed goes into a drift record.
        closed = self.dst.ok("tc_save", root=self.target, title="the end", close=True)
        self.assertEqual((closed["status"], closed["index"], closed["title"]),
                         ("closed", 1, data["step"]["title"]))
        self.assertEqual(sorted(os.listdir(steps)), before)
        shown = self.dst.ok("tc_show", root=self.target, include_drift=True)["drifts"]
        kept = [d for d in shown if d.get("kind") == "save"]
        self.assertEqual(len(kept), 1, shown)
        drift = os.path.join(self.target, ".checkpoints", "tasks", task_id, "drifts",
                             kept[0]["id"] + ".json")
        with open(drift, encoding="utf-8") as fh:
            self.assertIn("the end", json.load(fh)["reason"])
        self.dst.ok("tc_restore", root=self.target, drift_id=kept[0]["id"])  # restorable
        self.assertIn("more.txt", json.dumps(kept[0]))
        resumed = self.dst.ok("tc_resume", root=self.target)
        self.assertEqual((resumed["status"], resumed["drift_paths"]), ("closed", []))
        self.assertTrue(resumed["health"]["ok"], resumed["health"])

    def test_a_save_refused_at_the_highest_step_number_switches_no_task(self):
        full = self.import_at_the_highest_step_number()[0]
        other = self.dst.ok("tc_init", root=self.target, name="other")["task_id"]
        res = self.dst.call("tc_save", root=self.target, title="into the full one", task_id=full)
        self.assertTrue(res.is_error, res)
        resumed = self.dst.ok("tc_resume", root=self.target)
        self.assertEqual((resumed["task_id"], resumed["status"]), (other, "open"))

    def history_package(self):
        dst = os.path.join(self.crafts, "hist", os.path.basename(self.history_source))
        shutil.copytree(self.history_source, dst, symlinks=True)
        return dst

    def history_sha(self, package, rel):
        """The sha256 step 1 records for rel, as the history part of the package names it."""
        original = hashlib.sha256(self.files[rel]).hexdigest()
        with open(description_path(package), "rb") as fh:
            text = fh.read().decode("utf-8")
        self.assertIn(original, text, "step 1's content of %s not named in the package" % rel)
        return original

    def test_history_entry_with_dotdot_is_refused(self):
        package = self.history_package()
        data = load_description(package)
        # Only the history part is crafted: the current step stays valid, so
        # nothing but a check of the history's paths can refuse the package.
        renamed = 0
        for entry in data["history"]:
            files = entry["files"]
            if "src/data.bin" in files:
                files["../escape.bin"] = files.pop("src/data.bin")
                renamed += 1
        self.assertEqual(renamed, 2, data["history"])
        save_description(package, data)
        self.assert_refused_without_trace(package, "'..' path in the history")
        self.assertFalse(os.path.exists(os.path.join(self.target_parent, "escape.bin")))

    def test_history_payload_tampered_is_refused(self):
        package = self.history_package()
        sha = self.history_sha(package, "src/app.py")
        copies = [p for p in package_files(package) if sha in p]
        self.assertTrue(copies, "no content file named by %s in %r" % (sha, package_files(package)))
        for rel in copies:
            with open(os.path.join(package, rel), "r+b") as fh:
                fh.write(b"#")
        self.assert_refused_without_trace(package, "tampered history payload")

    def test_relative_or_missing_package_is_refused(self):
        missing = os.path.join(self.crafts, "nothing-handoff")
        self.assert_refused_without_trace(missing, "missing package")
        self.assert_refused_without_trace(os.path.basename(self.package), "relative package")

    def test_import_failing_midway_rolls_back_completely(self):
        # The receiver has a directory where the package wants a file; files
        # that sort before it would be written first and must be put back.
        os.makedirs(os.path.join(self.target, "src"), exist_ok=True)
        with open(os.path.join(self.target, "src", "app.py"), "wb") as fh:
            fh.write(b"receiver's app.py\n")
        os.makedirs(os.path.join(self.target, "src", "data.bin"))
        with open(os.path.join(self.target, "src", "data.bin", "inner.txt"), "wb") as fh:
            fh.write(b"inside a directory named like a package file\n")
        self.assert_refused_without_trace(self.package, "path occupied by a directory")
        self.assertEqual(file_bytes(self.target)["README.md"], b"receiver readme, must survive\n")
        self.assertEqual(file_bytes(self.target)["src/app.py"], b"receiver's app.py\n")
        # Once the obstacle is gone the same package imports.
        shutil.rmtree(os.path.join(self.target, "src", "data.bin"))
        res = self.dst.ok("tc_import", root=self.target, package=self.package)
        self.assertEqual(res["task_id"], self.task_id)
        got = file_bytes(self.target)
        for rel, data in self.files.items():
            self.assertEqual(got[rel], data, rel)
        self.assertEqual(got["mine.txt"], b"the receiver's own work\n")


class HandMadePackageTest(WorkspaceTest):
    """Packages written by hand (make_package): what an import refuses, and
    what it never writes over."""

    def test_import_never_writes_into_git_or_sensitive_files(self):
        os.makedirs(os.path.join(self.root, ".git", "hooks"))
        self.write(".env", "SECRET=mine\n")
        pkg = make_package(self.tmp, "evil-1", [
            (".git/hooks/pre-commit", b"#!/bin/sh\necho owned\n", 0o755),
            (".env", b"SECRET=theirs\n", 0o644),
            ("ok.txt", b"ok\n", 0o644)])
        srv = self.server()
        srv.call("tc_import", root=self.root, package=pkg)
        self.assertFalse(os.path.exists(os.path.join(self.root, ".git", "hooks", "pre-commit")),
                         "a package wrote a git hook")
        self.assertEqual(self.read(".env"), b"SECRET=mine\n", "a package overwrote .env")
        self.assertFalse(store_holds(self.store, b"SECRET=mine\n"),
                         "the content of .env reached the store")

    def test_import_does_not_silently_overwrite_unsaved_work(self):
        pkg = make_package(self.tmp, "other-1", [("notes.txt", b"from the package\n", 0o644)],
                           step={"index": 1, "title": "one"})
        self.write("notes.txt", "my own unsaved work\n")
        srv = self.server()
        res = srv.call("tc_import", root=self.root, package=pkg)
        if res.is_error:
            self.assertEqual(self.read("notes.txt"), b"my own unsaved work\n")
            return
        if self.read("notes.txt") == b"my own unsaved work\n":
            return
        # Overwritten: some drift record must bring the old bytes back.
        drifts = srv.ok("tc_show", root=self.root, include_drift=True)["drifts"]
        for drift in drifts:
            if srv.call("tc_restore", root=self.root, drift_id=drift["id"],
                        apply=True).is_error:
                continue
            if self.read("notes.txt") == b"my own unsaved work\n":
                return
        self.fail("tc_import replaced notes.txt and nothing can bring the old bytes back")

    def test_package_entries_that_would_damage_the_store_are_refused(self):
        # Whatever a package says ends up in the store's records: a content
        # name that is a path, a size that is not a number, a history entry of
        # the wrong form, a step without a title. Each is refused up front.
        srv = self.server()

        def edited(n, change):
            pkg = make_package(os.path.join(self.tmp, "bad%d" % n), "bad-%d" % n,
                               [("a.txt", b"a\n", 0o644)], step={"index": 1, "title": "one"})
            path = os.path.join(pkg, "handoff.json")
            with open(path, "rb") as fh:
                desc = json.loads(fh.read())
            change(desc)
            with open(path, "w", encoding="utf-8") as fh:
                json.dump(desc, fh)
            return pkg

        escape = "../../../../" + os.path.basename(self.tmp) + "-escaped"
        cases = [
            lambda d: d["files"][0].update(sha256=escape),
            lambda d: d["files"][0].update(size="1"),
            lambda d: d.update(history=[{"step": {"index": 1, "title": "one"},
                                         "files": {"a.txt": ["s", "ab" * 32, 2, 420, 0]}}]),
            lambda d: d.update(history=[{"step": {"index": 1, "title": "one"},
                                         "files": {"a.txt": ["f", sha(b"a\n"), -2, 420, 0]}}]),
            lambda d: d.update(step={"index": 1}),
            lambda d: d.update(step={"index": 1, "title": "one", "verified": "yes"}),
            lambda d: d.update(history=[{"step": {"index": 2, "title": "two"}, "files": {}}]),
            lambda d: d.update(history=[{"step": {"index": 1, "title": "one"}, "files": {}}] * 2),
            # Fields that look right to a lax reader and would be recorded wrong.
            lambda d: d["files"][0].update(size=999999),
            lambda d: d.update(history=[{"step": {"index": 1, "title": "one"},
                                         "files": {"a.txt": ["f", sha(b"a\n"), 5, 420, 0]}}]),
            lambda d: d["task"].update(exclude="zq"),
            lambda d: d.update(format=True),
            lambda d: d.update(format=1.0),
            lambda d: d["task"].update(task_id=d["task"]["task_id"] + "\n"),
        ]
        for n, change in enumerate(cases):
            with self.subTest(case=n):
                res = srv.call("tc_import", root=self.root, package=edited(n, change))
                self.assertTrue(res.is_error, res)
                self.assertRegex(res.text, "malformed|twice|lacks|gives|size its content"
                                 "|format|exclude must be|not a valid task id")
                self.assertFalse(os.path.exists(os.path.join(self.store, "tasks", "bad-%d" % n)))
                self.assertFalse(os.path.exists(self.root + "/a.txt"))
        self.assertEqual([n for n in os.listdir(os.path.dirname(self.tmp))
                          if n.endswith("-escaped")], [])

    def test_a_folder_that_is_no_package_is_named_so(self):
        plain = os.path.join(self.tmp, "project")
        write(plain, "src/a.py", "print(1)\n")
        if can_symlink():  # not every Windows user may make one
            os.symlink("src/a.py", os.path.join(plain, "link.py"))
        res = self.server().call("tc_import", root=self.root, package=plain)
        self.assertTrue(res.is_error, res)
        self.assertIn("has no handoff.json", res.text)

    @unittest.skipUnless(can_symlink(), "needs the right to make symlinks")
    def test_a_linked_package_description_is_refused_unread(self):
        pkg = make_package(self.tmp, "linked-1", [("a.txt", b"a\n", 0o644)])
        described = os.path.join(pkg, "handoff.json")
        os.rename(described, os.path.join(self.tmp, "elsewhere.json"))
        os.symlink(os.path.join(self.tmp, "elsewhere.json"), described)
        res = self.server().call("tc_import", root=self.root, package=pkg)
        self.assertTrue(res.is_error, res)
        self.assertIn("symlink", res.text)
        self.assertFalse(os.path.exists(os.path.join(self.root, "a.txt")))

    def test_malformed_package_step_is_a_tool_error(self):
        srv = self.server()
        for n, step in enumerate(({"index": "1", "title": "x"}, {"title": "no index"},
                                  ["x"], {"index": -3, "title": "x"})):
            pkg = make_package(os.path.join(self.tmp, "p%d" % n), "imp-%d" % n,
                               [("a.txt", b"a", 0o644)], step=step)
            reply = srv.request("tools/call", {"name": "tc_import", "arguments": {
                "root": self.root, "package": pkg}})
            self.assertNotIn("error", reply, (step, reply))
            self.assertTrue(reply["result"]["isError"], (step, reply))


class InterruptedTest(HandoffBase):
    """SIGKILL in the middle of an export or an import.

    Some kills happen at random times, others as soon as the operation is seen
    making progress on disk, so the dangerous window is hit on every run.
    """

    def big_source(self, srv):
        rng = random.Random(7)
        for i in range(40):
            self.write("src/f%03d.txt" % i, ("line %d\n" % i) * rng.randint(200, 1500))
        for i in range(2):
            self.write("blobs/b%d.bin" % i, os.urandom(512 * 1024))
        task_id = srv.ok("tc_init", root=self.root, name="big", goal="big goal")["task_id"]
        srv.ok("tc_save", root=self.root, title="all", conclusion="c", next="big next")
        return task_id

    def start_and_kill(self, tool, arguments, trigger, delay):
        """Send one tool call, wait for trigger() (or delay seconds), then SIGKILL."""
        victim = self.server()
        victim.send_raw((json.dumps({
            "jsonrpc": "2.0", "id": 99, "method": "tools/call",
            "params": {"name": tool, "arguments": arguments}}) + "\n").encode())
        deadline = time.monotonic() + (delay if trigger is None else 5.0)
        while time.monotonic() < deadline:
            if trigger is not None and trigger():
                break
            time.sleep(0.0005)
        victim.kill()

    def test_export_killed_midway_leaves_no_partial_package(self):
        srv = self.server()
        task_id = self.big_source(srv)
        ref_out = self.other_dir("tc-ref-")
        started = time.monotonic()
        ref = srv.ok("tc_export", root=self.root, to=ref_out)["path"]
        duration = time.monotonic() - started
        srv.close()
        expected = package_files(ref)
        rng = random.Random(11)
        moments = [("anything in 'to'", lambda out: lambda: os.listdir(out), 0),
                   ("20 entries written", lambda out: lambda: sum(
                       len(f) for _d, _s, f in os.walk(out)) >= 20, 0)]
        moments += [("%.3fs" % d, None, d) for d in
                    (duration * rng.uniform(0.1, 0.5), duration * rng.uniform(0.5, 0.9))]
        retry = None
        for label, make_trigger, delay in moments:
            out = self.other_dir("tc-out-")
            why = "export killed at %s (export takes %.3fs)" % (label, duration)
            self.start_and_kill("tc_export", {"root": self.root, "to": out},
                                make_trigger(out) if make_trigger else None, delay)
            final = os.path.join(out, task_id + "-handoff")
            with self.subTest(moment=label):
                finished = os.path.exists(final)
                if finished:
                    self.assertEqual(package_files(final), expected, why)
                retry = retry or self.server()
                # The next call that locks the store removes the dead export's
                # unfinished package, whatever the call.
                retry.ok("tc_resume", root=self.root)
                self.assertEqual(os.listdir(out), [os.path.basename(final)] if finished else [],
                                 why)
                res = retry.call("tc_export", root=self.root, to=out)
                if finished:
                    self.assertTrue(res.is_error, "%s: existing package overwritten" % why)
                else:
                    self.assertFalse(res.is_error, "%s: retry failed: %s" % (why, res.text))
                    self.assertEqual(package_files(res["path"]), expected, why)
                    # The dead export's temporary package is cleared by the retry.
                    self.assertEqual(os.listdir(out), [os.path.basename(res["path"])], why)

    @unittest.skipIf(os.name == "nt", "folder locks are POSIX")
    def test_a_package_still_being_built_elsewhere_is_left_alone(self):
        import fcntl
        srv = self.server()
        task_id = self.big_source(srv)
        out = self.other_dir("tc-out-")
        # Another process (a server on a copy of this store, say) is building
        # a package of this task in the same folder: it holds its folder's lock.
        live = os.path.join(out, ".%s-handoff.tmp-0123abcd" % task_id)
        os.makedirs(os.path.join(live, "files"))
        holder = os.open(live, os.O_RDONLY)
        fcntl.flock(holder, fcntl.LOCK_EX | fcntl.LOCK_NB)
        try:
            # This store's note names it too, as a copy of the other's would.
            note_of(self.store, live)
            srv.ok("tc_resume", root=self.root)
            package = srv.ok("tc_export", root=self.root, to=out)["path"]
            self.assertTrue(os.path.isdir(os.path.join(live, "files")), "a live export was removed")
            self.assertEqual(sorted(os.listdir(out)),
                             sorted([os.path.basename(live), os.path.basename(package)]))
        finally:
            os.close(holder)
        # Once nobody builds it, the next lock of the store removes it.
        note = note_of(self.store, live)
        srv.ok("tc_resume", root=self.root)
        self.assertEqual(os.listdir(out), [os.path.basename(package)])
        self.assertFalse(os.path.exists(note))

    @unittest.skipIf(os.name == "nt", "FIFOs are POSIX")
    def test_notes_that_are_not_an_exports_never_block_the_store(self):
        srv = self.server()
        self.big_source(srv)
        out = self.other_dir("tc-out-")
        victim = os.path.join(out, "keep.json")
        write(out, "keep.json", "{}")
        notes = os.path.join(self.store, "exporting")
        os.makedirs(notes)
        os.mkfifo(os.path.join(notes, ".x-handoff.tmp-00.json"))
        write(notes, ".y-handoff.tmp-01.json", "[" * 100000 + "]" * 100000)
        write(notes, ".z-handoff.tmp-02.json", json.dumps({"tmp": out + "/.z-handoff.tmp-02\x00"}))
        write(notes, ".v-handoff.tmp-04.json",
              json.dumps({"tmp": out + "/x\ud800y/.v-handoff.tmp-04"}))  # (no file has it)
        os.symlink(victim, os.path.join(notes, ".w-handoff.tmp-03.json"))
        answered = []
        caller = threading.Thread(target=lambda: answered.append(
            srv.call("tc_resume", root=self.root)), daemon=True)
        caller.start()
        caller.join(20)
        if caller.is_alive():
            srv.kill()
            self.fail("a note that is a FIFO blocked the store")
        self.assertFalse(answered[0].is_error, answered[0].text)
        self.assertTrue(os.path.isfile(victim), "a linked note's target was touched")
        self.assertEqual(os.listdir(notes), [])
        # A store whose note folder is a file gets its folder back at an export.
        os.rmdir(notes)
        write(self.store, "exporting", "not a folder")
        srv.ok("tc_export", root=self.root, to=out)
        self.assertTrue(os.path.isdir(notes))

    def check_after_restart(self, target, package, task_id, before, complete, why):
        """After a restart the first call sees a complete import or none; a retry works."""
        restarted = self.server()
        resume = restarted.call("tc_resume", root=target)
        state = hashed_state(target)
        store = os.path.join(target, ".checkpoints")
        task_dir = os.path.exists(os.path.join(store, "tasks", task_id))
        diff = sorted(k for k in set(state) | set(before) if state.get(k) != before.get(k))
        if not resume.is_error:
            outcome = "complete"
            self.assertEqual(resume["goal"], "big goal", why)
            self.assertEqual(state, complete, "%s: task active but files differ" % why)
        else:
            outcome = "none"
            self.assertEqual(state, before, "%s: tc_resume says %r but the workspace holds "
                             "a half-written import: %s" % (why, resume.text, diff[:8]))
            self.assertFalse(task_dir, "%s: half-written task left in the store" % why)
        # Whatever the first call saw, a retry ends in one complete import.
        retry = restarted.call("tc_import", root=target, package=package)
        if outcome == "none":
            self.assertFalse(retry.is_error, "%s: retry failed: %s" % (why, retry.text))
            self.assertEqual(retry["task_id"], task_id, why)
        else:
            self.assertTrue(retry.is_error, "%s: duplicate import accepted" % why)
        self.assertEqual(hashed_state(target), complete, why)
        self.assertEqual(restarted.ok("tc_resume", root=target)["goal"], "big goal", why)
        restarted.close()
        return outcome

    def test_import_killed_at_random_moments_is_all_or_nothing(self):
        srv = self.server()
        task_id = self.big_source(srv)
        package = self.export(srv)["path"]
        srv.close()
        template = os.path.join(self.other_dir("tc-template-"), "ws")
        os.makedirs(os.path.join(template, "src"))
        with open(os.path.join(template, "src", "f005.txt"), "wb") as fh:
            fh.write(b"the receiver's version of f005\n")
        with open(os.path.join(template, "notes.txt"), "wb") as fh:
            fh.write(b"receiver notes\n")
        before = hashed_state(template)

        ref = os.path.join(self.other_dir("tc-refimport-"), "ws")
        shutil.copytree(template, ref)
        started = time.monotonic()
        self.server().ok("tc_import", root=ref, package=package)
        duration = time.monotonic() - started
        complete = hashed_state(ref)
        self.assertNotEqual(complete, before)

        def new_entries(target, n):
            return lambda: (len(os.listdir(os.path.join(target, "src")))
                            + (os.path.isdir(os.path.join(target, "blobs")) and
                               len(os.listdir(os.path.join(target, "blobs"))))) > n
        rng = random.Random(23)
        moments = [
            ("first workspace entry", lambda t: new_entries(t, 1), 0),
            ("half the files", lambda t: new_entries(t, 21), 0),
            ("task directory in store", lambda t: lambda: os.path.isdir(
                os.path.join(t, ".checkpoints", "tasks", task_id)), 0),
        ]
        moments.append(("random", None, duration * rng.uniform(0.05, 0.95)))
        for label, make_trigger, delay in moments:
            why = "import killed at %s (import takes %.3fs)" % (label, duration)
            target = os.path.join(self.other_dir("tc-kill-"), "ws")
            shutil.copytree(template, target)
            self.start_and_kill("tc_import", {"root": target, "package": package},
                                make_trigger(target) if make_trigger else None, delay)
            with self.subTest(moment=label):
                self.check_after_restart(target, package, task_id, before, complete, why)


LIST_AS_USER = """
import sys
sys.path.insert(0, sys.argv[1])
import tc
print(sorted(tc.package_files(sys.argv[2])))
"""


class UnreadableFolderTest(unittest.TestCase):
    """A folder of a package that cannot be listed is left out, as before."""

    @unittest.skipUnless(keeps_mode_bits(), "needs permission bits that stop a folder's "
                                            "listing (Windows keeps only a read-only flag)")
    def test_an_unlistable_folder_does_not_fail_the_listing(self):
        base = tempfile.mkdtemp(prefix="tc-pkg-")
        self.addCleanup(shutil.rmtree, base, True)
        os.chmod(base, 0o755)
        for rel in ("files/src/app.py", "extra/private.txt"):
            path = os.path.join(base, *rel.split("/"))
            os.makedirs(os.path.dirname(path), exist_ok=True)
            with open(path, "w") as fh:
                fh.write("x\n")
            os.chmod(os.path.dirname(path), 0o755)
            os.chmod(path, 0o644)
        os.chmod(os.path.join(base, "files"), 0o755)
        os.chmod(os.path.join(base, "extra"), 0o000)
        self.addCleanup(os.chmod, os.path.join(base, "extra"), 0o755)
        command = [sys.executable, "-c", LIST_AS_USER, SCRIPTS, base]
        env = clean_env({"PYTHONDONTWRITEBYTECODE": "1"})
        if hasattr(os, "geteuid") and os.geteuid() == 0:
            if not shutil.which("setpriv"):
                self.skipTest("running as root without setpriv: permissions are not enforced")
            command = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups"] + command
            probe = subprocess.run(command[:5] + ["-c", "import sys; sys.path.insert(0, %r); "
                                                  "import tc" % SCRIPTS],
                                   capture_output=True, text=True, timeout=60, env=env)
            if probe.returncode != 0:
                self.skipTest("this interpreter cannot run as an unprivileged user: %s"
                              % probe.stderr.strip()[-200:])
        proc = subprocess.run(command, capture_output=True, text=True, timeout=60, env=env)
        self.assertEqual(proc.returncode, 0, proc.stderr)
        self.assertEqual(proc.stdout.strip(), "['files/src/app.py']")


if __name__ == "__main__":
    unittest.main()
