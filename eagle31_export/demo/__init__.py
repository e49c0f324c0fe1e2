"""The demo: an embedded pair (examples/<name>/models in a checkout) through every command."""
