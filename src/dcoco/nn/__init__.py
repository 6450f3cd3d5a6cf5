"""Small neural building blocks shared by the trained drafters."""
