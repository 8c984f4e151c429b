"""The request pipeline every entry point goes through: a request however it arrives, with every
refusal (request.py); a request made into a sequence, its engine, prompt and first state's source
chosen (prepare.py); requests run alone or batched into records (runner.py)."""
