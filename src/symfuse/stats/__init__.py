"""Per-model statistics: input Gram matrices, diagonal Fisher."""
