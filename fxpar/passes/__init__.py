"""Graph passes: each rewrites or annotates the global graph under a written contract."""
