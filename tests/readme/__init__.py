"""What tests/test_readme.py needs to check README.md and docs/*.md: the snippets extracted
(:mod:`.extract`), the database they run in and how SQL runs there (:mod:`.world`), and the
checks of shell command lines (:mod:`.shell`)."""
