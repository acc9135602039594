"""Example handler apps that ship with the package (used by ``docker-compose.yml`` and the README)."""
