//! ZeRO stage 3 (FSDP units) over 2 real processes talking TCP, launched by `burnrun`, gives
//! the losses of single-device training with the same global-norm clipping.

use burn_parallel::run_local;
use examples::data::Corpus;
use examples::train_zero::train_gpt_reference;
use tests::{assert_same_losses, gpt_through_burnrun, tiny_gpt_run};

#[test]
fn zero3_over_tcp_processes_matches_single_device() {
    let config = tiny_gpt_run(20);
    let corpus = Corpus::load_default().expect("the bundled corpus");
    let reference = run_local(1, |g| train_gpt_reference(&g, &config, &corpus, Some(0.5)))
        .expect("reference run")
        .remove(0);

    let (tcp, stdout) = gpt_through_burnrun(2, &config, &["--zero", "3", "--clip", "0.5"]);
    // Both processes report their sharded memory.
    assert!(stdout.contains("[rank 0] [rank 0] zero memory"), "{stdout}");
    assert!(stdout.contains("[rank 1] [rank 1] zero memory"), "{stdout}");
    assert_same_losses(&reference, &tcp, 1e-5, "ZeRO-3 over 2 tcp processes");
}
