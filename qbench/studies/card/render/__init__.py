"""The card's pages, from card.json alone: they format and draw, and compute no number."""
