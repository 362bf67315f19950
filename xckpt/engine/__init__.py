"""How bytes move: region and plan maths, collectives, storage, writing, reading, commit."""
