"""Generative retrieval: the semantic-ID decoder, its fixed-step beam decode and the valid-path trie."""
