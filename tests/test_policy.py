"""PathPolicy: which workspace paths a scan skips and which it treats as sensitive.

Pure decisions with no I/O, so they are checked with tables of names. Paths
are posix-style and relative to the workspace root. The last class checks
the same rules through a real server, with what a save says it left out.
"""

import json
import os
import sys
import unittest

import support
from support import ToolsTest, paths_of

sys.path.insert(0, support.SCRIPTS)
import tc  # noqa: E402


def policy(exclude=(), store_rel=None):
    return tc.PathPolicy(exclude=tuple(exclude), store_rel=store_rel)


class TableMixin:
    """Run one predicate over a table and report every mismatch at once."""

    def check_table(self, predicate, paths, expected, label):
        wrong = [p for p in paths if bool(predicate(p)) != expected]
        self.assertEqual(wrong, [], "%s should be %s for these paths" % (label, expected))


class AlwaysExcludedTest(TableMixin, unittest.TestCase):
    ALWAYS = [".git", ".checkpoints", ".task-checkpoint-store.json", ".branches",
              ".history", "backup", "backup_2024", "backups", "notes.bak", ".cursor",
              ".idea", ".vscode", ".workbuddy", "node_modules", "__pycache__",
              ".venv", "venv", "target", "dist", "build"]

    def test_top_level_names(self):
        self.check_table(policy().excluded, self.ALWAYS, True, "excluded")

    def test_folder_names_at_any_depth(self):
        deep = []
        for name in self.ALWAYS:
            deep.append("pkg/" + name)
            deep.append("a/b/c/" + name)
        self.check_table(policy().excluded_folder, deep, True, "an excluded folder")
        self.check_table(policy().excluded, [path + "/inside.txt" for path in deep], True,
                         "excluded")

    def test_a_file_below_the_top_is_never_excluded_by_its_own_name(self):
        # A pattern matches one name segment: a folder's name at any depth or
        # the first segment of the path, never the name of a deeper file.
        paths = ["src/backup_manager.py", "src/notes.bak", "lib/backup.py", "a/b/build",
                 "pkg/dist", "tools/target"]
        self.check_table(policy().excluded, paths, False, "excluded")
        self.check_table(policy().excluded, ["backup_manager.py", "notes.bak", "build"], True,
                         "excluded")

    def test_paths_below_excluded_directories(self):
        paths = [".git/config", ".git/objects/ab/cdef", "node_modules/left-pad/index.js",
                 "web/node_modules/react/index.js", "src/__pycache__/mod.cpython-311.pyc",
                 ".venv/lib/python3.11/site.py", "venv/bin/python", "rust/target/debug/app",
                 "dist/pkg-1.0.tar.gz", "docs/build/html/index.html",
                 "backup_old/main.py", ".checkpoints/tasks/t/state.json",
                 ".idea/workspace.xml", "sub/.vscode/settings.json", "old.bak"]
        self.check_table(policy().excluded, paths, True, "excluded")

    def test_ordinary_paths_are_kept(self):
        paths = ["main.py", "src/app.py", "README.md", "builds/log.txt", "distance.py",
                 "src/targets.py", "my_backup.txt", "notes.bak.txt", "venv_notes.md",
                 "src/build_tools.py", "docs/history.md", "gitignore.txt", "bak",
                 "src/node_modules_doc.md", "a/b/c/deep.txt"]
        self.check_table(policy().excluded, paths, False, "excluded")


class ExcludePatternTest(TableMixin, unittest.TestCase):
    def test_plain_name_excludes_that_directory_at_any_depth(self):
        pol = policy(exclude=["config"])
        self.check_table(pol.excluded, ["config", "config/database.yaml",
                                        "app/config/settings.ini", "a/b/config/x/y.txt"],
                         True, "excluded")
        self.check_table(pol.excluded, ["configs/x.yaml", "myconfig/x", "config.yaml",
                                        "src/configure.py"], False, "excluded")

    def test_glob_patterns_match_single_segments(self):
        pol = policy(exclude=["*.log", "tmp*"])
        self.check_table(pol.excluded, ["server.log", "tmp", "tmp_data/a.txt",
                                        "x/tmpfiles/b.txt", "app.log/inside.txt"], True,
                         "excluded")
        self.check_table(pol.excluded, ["server.log.txt", "src/atmp.py", "logs/app.txt",
                                        "logs/app.log", "src/tmp_helpers.py"],
                         False, "excluded")

    def test_patterns_do_not_replace_the_always_excluded_names(self):
        pol = policy(exclude=["config"])
        self.assertTrue(pol.excluded("node_modules/x.js"))
        self.assertTrue(pol.excluded(".git/HEAD"))

    def test_no_patterns_by_default(self):
        self.assertFalse(policy().excluded("config/database.yaml"))


class StoreInsideWorkspaceTest(TableMixin, unittest.TestCase):
    def inside(self, pol):
        # The store decision may be its own predicate or part of excluded().
        for name in ("inside_store", "in_store", "is_store_path"):
            fn = getattr(pol, name, None)
            if fn is not None:
                return lambda p: fn(p) or pol.excluded(p)
        return pol.excluded

    def test_custom_store_inside_the_workspace_is_skipped(self):
        pol = policy(store_rel="var/cp-store")
        check = self.inside(pol)
        self.check_table(check, ["var/cp-store", "var/cp-store/tasks/t/state.json",
                                 "var/cp-store/payload/ab/abcdef"], True, "in store")
        self.check_table(pol.excluded, ["var/other.txt", "var/cp-store-notes.md",
                                        "cp-store/x.txt", "var/cp/store.txt"],
                         False, "excluded")


class SensitiveDirectoryTest(TableMixin, unittest.TestCase):
    def test_named_directories(self):
        paths = []
        for name in (".ssh", ".aws", ".gnupg", ".docker", ".kube", ".env", ".envdir",
                     ".secrets", ".tokens"):
            paths.append(name + "/notes.md")
            paths.append("home/user/" + name + "/readme.txt")
        self.check_table(policy().sensitive, paths, True, "sensitive")

    def test_directories_whose_name_holds_a_keyword(self):
        paths = ["my_secrets/notes.md", "app-secret-store/main.py", "credentials/readme.txt",
                 "svc/user_credentials_v2/data.bin", "tokens/list.md", "a/api-token-cache/x.py"]
        self.check_table(policy().sensitive, paths, True, "sensitive")


class SensitiveFileTest(TableMixin, unittest.TestCase):
    UNAMBIGUOUS = [
        ".env", ".env.local", ".env.production", "prod.env", ".envrc",
        "server.pem", "server.key", "cert.p12", "cert.pfx", "AuthKey_ABC.p8", "release.jks",
        "app.keystore", "vault.kdbx", "putty.ppk", "office.ovpn",
        "deploy_rsa", "host_dsa", "user_ed25519", "host_ecdsa", "signing_key",
        ".netrc", ".git-credentials", ".npmrc", ".pypirc", ".pgpass", ".htpasswd",
        ".my.cnf", "my.cnf", "passwd", "shadow",
        "kubeconfig", "prod.kubeconfig", "terraform.tfstate", "terraform.tfvars",
        "prod.tfvars", "session.jwt",
        "credentials", "credentials.json", "creds", "creds.yaml", "secret", "secrets.json",
        "token", "token.json", "token.txt", "github.token", "gh_token", "auth.json",
        "settings.py", "local_settings.py", "settings.xml", "wp-config.php", "web.config",
        "wrangler.toml", ".dev.vars",
    ]

    def test_unambiguous_names_at_top_level(self):
        self.check_table(policy().sensitive, self.UNAMBIGUOUS, True, "sensitive")

    def test_unambiguous_names_in_subdirectories(self):
        paths = ["deploy/" + name for name in self.UNAMBIGUOUS]
        self.check_table(policy().sensitive, paths, True, "sensitive")

    def test_envrc_with_a_prefix(self):
        # The English list has *.envrc among the unambiguous dotenv names.
        self.check_table(policy().sensitive, ["app.envrc", "deploy/prod.envrc"], True,
                         "sensitive")

    def test_key_file_names(self):
        paths = ["id_rsa", "id_dsa", "id_ecdsa", "id_ed25519", "keys/id_rsa",
                 "home/me/id_ed25519"]
        self.check_table(policy().sensitive, paths, True, "sensitive")

    def test_cloud_service_credentials(self):
        paths = ["service-account.json", "service-account-prod.yaml", "service_account.json",
                 "gcp/service_account_key.json", "prod.serviceaccount.json",
                 "deploy/ci.serviceaccount.json", "firebase.json",
                 "firebase-adminsdk-x1y2.json", "web/firebase-config.json",
                 "appsettings.json", "appsettings.Development.json",
                 "api/appsettings.Production.json"]
        self.check_table(policy().sensitive, paths, True, "sensitive")

    def test_firebase_source_files_are_not_secrets(self):
        # firebase* guards service-account keys, which are JSON: a script
        # that sets up the client library is source code, stored like any.
        paths = ["src/firebase_init.js", "web/firebase-config.js", "lib/firebase.ts",
                 "firebase_app.py"]
        self.check_table(policy().sensitive, paths, False, "stored")


class AmbiguousSubstringTest(TableMixin, unittest.TestCase):
    def test_blocked_with_a_config_suffix(self):
        paths = ["prod_credentials.json", "config/prod_credentials.json", "db_password.yaml",
                 "app_secret.yml", "mail_passwd.toml", "stripe_api_key.ini", "x_apikey.cfg",
                 "svc_auth_token.conf", "user_token_cache.properties", "my_secret.xml",
                 "reset_password.txt", "db_password.sql", "set_password.sh",
                 "token_setup.ps1", "secret_env.bat", "apikey.cmd", "site_credential.php",
                 "db_password.cnf", "app_password.config"]
        self.check_table(policy().sensitive, paths, True, "sensitive")

    def test_not_blocked_in_source_and_docs(self):
        paths = ["src/password_policy.py", "src/tokenizer.py", "docs/secrets.md",
                 "src/api_key_loader.py", "lib/credential_helper.rb", "tests/test_tokens.py"]
        self.check_table(policy().sensitive, paths, False, "sensitive")

    def test_credentials_and_creds_prefixes_whatever_follows(self):
        # Unambiguous in the specification: any extension, any rest of the name.
        paths = ["credentials.csv", "credentials.py", "creds.py", "creds.md",
                 "credentials.md", "aws/credentials_backup.tar", "credsfile.bin"]
        self.check_table(policy().sensitive, paths, True, "sensitive")

    def test_secret_prefix_only_without_an_extension_or_with_a_config_suffix(self):
        self.check_table(policy().sensitive, ["secret", "secret.env", "secrets.yaml",
                                              "secret_key"], True, "sensitive")
        self.check_table(policy().sensitive, ["docs/secrets.md", "secret_sauce.py"], False,
                         "sensitive")

    def test_blocked_without_an_extension(self):
        paths = ["mytoken", "creds", "my_creds", "bin/mytoken", "db_password", "app_secret"]
        self.check_table(policy().sensitive, paths, True, "sensitive")


class NotSensitiveTest(TableMixin, unittest.TestCase):
    def test_ordinary_files(self):
        # Credentials with innocent names are the documented false negatives.
        paths = ["main.py", "README.md", "src/app.py", "package.json", "config.json",
                 "docker-compose.yml", "config/database.yaml", "Makefile", "LICENSE",
                 "src/keyboard.py", "docs/authentication.md", "model.p3d", "data/table.csv",
                 "src/environment.py", "env.md", "notes/tokenless.md"]
        self.check_table(policy().sensitive, paths, False, "sensitive")

    def test_sensitive_does_not_depend_on_exclude(self):
        pol = policy(exclude=["config"])
        self.assertTrue(pol.sensitive("keys/server.pem"))
        self.assertFalse(pol.sensitive("src/main.py"))


class GlobSetTest(unittest.TestCase):
    """The name matcher answers exactly as fnmatch's whole-name regex would,
    for the built-in lists and for patterns of every shape a user may give."""

    PATTERN_SETS = (
        tc.ALWAYS_EXCLUDED, tc.SENSITIVE_FILES,
        ("*", "**", "*.*", "a*", "*b", "*c*", "d?e", "[xy]z", "[!q]r", "lit", "*.log",
         "x*.y", "*a.b*", "?", "tmp*", "*~", "a[", "é*"),
    )

    def test_same_answers_as_the_regex(self):
        import random
        rng = random.Random(7)
        for patterns in self.PATTERN_SETS:
            pieces = sorted({part for p in patterns
                             for part in p.replace("?", "*").replace("[", "*")
                             .replace("]", "*").replace("!", "*").split("*") if part})
            pieces += ["", ".", "x", "Q", "-", "*", "?", "a.b", "é", "\n"]
            fast, regex = tc.GlobSet(patterns), tc.compile_globs(patterns)
            wrong = []
            for _ in range(20000):
                name = "".join(rng.choice(pieces) for _ in range(rng.randint(1, 4))) or "n"
                if fast.match(name) != (regex.match(name) is not None):
                    wrong.append(name)
            self.assertEqual(wrong[:10], [], patterns[:4])

    def test_matches_whole_names_only(self):
        fast = tc.GlobSet(("*.log", "tmp*", "*cache*", "exact", "a?c"))
        for name in ("x.log", "tmp", "tmpdir", "mycaches", "cache", "exact", "abc"):
            self.assertTrue(fast.match(name), name)
        for name in ("x.log.txt", "atmp", "exactly", "xexact", "abcd", "ac", "cach"):
            self.assertFalse(fast.match(name), name)

class LeftOutThroughTheServerTest(ToolsTest):
    """What the name rules and the sensitive list leave out, through a real
    server: a deeper file is never left out by its own name, and what is
    left out is said at the first save (or tc_init) that meets it."""

    def test_a_deeper_file_named_like_an_excluded_pattern_is_recorded_and_restored(self):
        self.write("src/backup_manager.py", "good\n")
        self.write("src/notes.bak", "kept\n")
        self.init()
        first = self.save("one")["index"]
        self.write("src/backup_manager.py", "broken edit\n")
        self.save("two")
        self.ok("tc_restore", root=self.root, index=first, apply=True)
        self.assertEqual(self.read("src/backup_manager.py"), b"good\n")
        files = paths_of(self.ok("tc_show", root=self.root, index=first)["steps"][0]["files"])
        self.assertIn("src/backup_manager.py", files)
        self.assertIn("src/notes.bak", files)

    def test_a_step_recorded_under_the_older_name_rule_keeps_what_that_rule_left_out(self):
        self.write("src/app.py", "v1\n")
        task_id = self.init()["task_id"]
        first = self.save("one")["index"]
        # A record written before deeper files were recorded by their own
        # name carries no "names" mark: its missing files may be ones the
        # older rule left out, not ones made later.
        step_path = os.path.join(self.task_dir(task_id), "steps", "s%04d.json" % first)
        with open(step_path, encoding="utf-8") as fh:
            record = json.load(fh)
        record.pop("names", None)
        with open(step_path, "w", encoding="utf-8") as fh:
            json.dump(record, fh)
        self.write("src/backup_manager.py", "made later\n")
        self.write("src/fresh.py", "made later\n")
        self.save("two")
        plan = self.ok("tc_restore", root=self.root, index=first, apply=True)
        self.assertEqual(self.read("src/backup_manager.py"), b"made later\n")
        self.assertFalse(os.path.exists(os.path.join(self.root, "src", "fresh.py")),
                         "a file the older rule recorded is still deleted")
        kept = {item["path"]: item["reason"] for item in plan["plan"]["unrestorable"]}
        self.assertIn("src/backup_manager.py", kept)
        self.assertIn("before", kept["src/backup_manager.py"])

    def test_init_and_the_first_save_name_what_is_left_out_and_later_saves_only_the_new(self):
        self.write("src/settings.py", "SECRET_KEY = 'x'\n")
        self.write("node_modules/left-pad/index.js", "x\n")
        self.write("backup.txt", "old\n")
        self.write("src/app.py", "app\n")
        init = self.init()
        reasons = {item["path"]: item["reason"] for item in init["skipped_paths"]}
        self.assertEqual(sorted(reasons), ["backup.txt", "node_modules", "src/settings.py"])
        self.assertIn("sensitive", reasons["src/settings.py"])
        self.assertIn("'node_modules'", reasons["node_modules"])
        self.assertIn("'backup*'", reasons["backup.txt"])
        self.assertEqual(self.save("one")["skipped_paths"], [], "said once is enough")
        self.write("src/local_settings.py", "x\n")
        self.write("web/dist/bundle.js", "x\n")
        later = paths_of(self.save("two")["skipped_paths"])
        self.assertEqual(later, {"src/local_settings.py", "web/dist"})

    def test_what_is_left_out_is_bounded_in_a_result(self):
        for number in range(130):
            self.write("d%03d/node_modules/x.js" % number, "x\n")
        init = self.init()
        self.assertEqual(len(init["skipped_paths"]), 100)
        self.assertEqual(init["omitted"], {"skipped_paths": 30})


if __name__ == "__main__":
    unittest.main()
