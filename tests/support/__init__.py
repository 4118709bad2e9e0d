"""Test helpers shared by the test modules (launching ranks, datasets, references, checks); no tests here."""
