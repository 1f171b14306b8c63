"""The shipped docker-compose.yml started for real (`make test-compose`)."""
