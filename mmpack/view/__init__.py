"""`mmpack view`: a static, offline web page that shows a packed dataset (or raw records packed on the spot) as the
model sees it: the `mmpack stats` overview, the bins, each bin's tokens, trained tokens, positions and pixels."""

# The position rules the page can show on hover (`mmpack.view.bins.position_rule_for`).
POSITION_RULES = ("auto", "mrope", "mrope-frames-apart", "text", "1d")
