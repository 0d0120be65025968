"""Training data: the store-backed block loader, several stores as one, COD element sampling."""
