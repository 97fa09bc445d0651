//! CSV and TOML round trips, the grammar's error messages, and loaded schedules going
//! through the validator.

use burn_pipeline::format::{
    FormatError, from_csv, from_toml, load, parse_csv, parse_toml, render_programs, save, to_csv,
    to_toml,
};
use burn_pipeline::generators::{gpipe, interleaved_1f1b, one_f_one_b, zb_h1, zbv};
use burn_pipeline::validate::ValidationError;
use burn_pipeline::{PlacementStyle, Schedule, ScheduleKind};

fn samples() -> Vec<Schedule> {
    vec![
        gpipe(3, 4).unwrap(),
        one_f_one_b(4, 8).unwrap(),
        interleaved_1f1b(2, 4, 2).unwrap(),
        interleaved_1f1b(3, 3, 3).unwrap(),
        zb_h1(4, 6).unwrap(),
        zbv(3, 6).unwrap(),
    ]
}

#[test]
fn csv_round_trip() {
    for s in samples() {
        let text = to_csv(&s);
        let back = from_csv(&text).unwrap_or_else(|e| panic!("{}: {e}\n{text}", s.kind()));
        // CSV does not carry the kind: everything else must survive.
        assert_eq!(back.kind(), ScheduleKind::Custom);
        assert_eq!(back.programs(), s.programs());
        assert_eq!(
            back.placement().stage_to_rank(),
            s.placement().stage_to_rank()
        );
        assert_eq!(back.num_microbatches(), s.num_microbatches());
        assert_eq!(back.fingerprint(), s.fingerprint());
    }
    assert_eq!(
        from_csv(&to_csv(&zbv(2, 4).unwrap()))
            .unwrap()
            .placement()
            .style(),
        PlacementStyle::V
    );
}

#[test]
fn toml_round_trip() {
    for s in samples() {
        let text = to_toml(&s);
        assert_eq!(from_toml(&text).unwrap(), s, "{text}");
    }
}

#[test]
fn files_round_trip_by_extension() {
    let dir = std::env::temp_dir().join(format!("burn-pipeline-format-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let s = zb_h1(3, 5).unwrap();
    for name in ["s.csv", "s.toml"] {
        let path = dir.join(name);
        save(&s, &path).unwrap();
        let back = load(&path).unwrap();
        assert_eq!(back.programs(), s.programs());
    }
    assert!(matches!(
        save(&s, dir.join("s.json")),
        Err(FormatError::UnknownExtension { .. })
    ));
    let err = load(dir.join("missing.csv")).unwrap_err();
    assert!(matches!(err, FormatError::Io { op: "read", .. }), "{err}");
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn csv_accepts_comments_padding_and_unquoted_transfers() {
    let csv = "# a hand-written 2-rank GPipe\n\
               0F0, SEND_F(0->1,m0) ,RECV_B(1->0,m0),0B0,REDUCE(0),,\n\
               \n\
               RECV_F(0->1,m0),1F0,1B0,\"SEND_B(1->0,m0)\",REDUCE(1)\n";
    let s = from_csv(csv).unwrap();
    assert_eq!(s.num_ranks(), 2);
    assert_eq!(s.num_microbatches(), 1);
    assert_eq!(s.program(0).len(), 5);
}

#[test]
fn bad_files_say_where_and_what() {
    let err = parse_csv("0F0,0X1\n").unwrap_err();
    assert!(matches!(err, FormatError::Action { .. }));
    assert!(
        err.to_string()
            .starts_with("CSV line 1, field 2: cannot parse pipeline action `0X1`"),
        "{err}"
    );
    let err = parse_csv("0F0,\"SEND_F(0->1,m0)\n").unwrap_err();
    assert!(matches!(err, FormatError::Csv { line: 1, .. }), "{err}");
    assert!(matches!(
        parse_csv("# nothing\n").unwrap_err(),
        FormatError::Empty
    ));
    // Stage 1 is only a peer: no rank computes it.
    let err = parse_csv("0F0,\"SEND_F(0->1,m0)\"\n").unwrap_err();
    assert!(
        matches!(err, FormatError::UnplacedStage { stage: 1 }),
        "{err}"
    );

    let err = parse_toml(
        "microbatches = 1\nstage_to_rank = [0]\n[[rank]]\nactions = [\"0F0\", \"0Q0\"]\n",
    )
    .unwrap_err();
    assert!(
        err.to_string().starts_with("TOML rank 0, action 1:"),
        "{err}"
    );
    let err = parse_toml("microbatches = 1\nstage_to_rank = [0]\nranks = []\n").unwrap_err();
    assert!(matches!(err, FormatError::Toml(_)), "{err}");
    let err = parse_toml(
        "kind = \"pipedream\"\nmicrobatches = 1\nstage_to_rank = [0]\n[[rank]]\nactions = []\n",
    )
    .unwrap_err();
    assert!(
        err.to_string().contains("unknown schedule `pipedream`"),
        "{err}"
    );
    let err = parse_toml("microbatches = 1\nstage_to_rank = [0, 3]\n[[rank]]\nactions = []\n")
        .unwrap_err();
    assert!(matches!(err, FormatError::Schedule(_)), "{err}");
}

/// A loaded schedule goes through the validator: here a hand-edited 1F1B where rank 1
/// receives its second activation after the forward that needs it.
#[test]
fn loaded_schedules_are_validated_and_the_culprit_is_marked() {
    let good = to_csv(&one_f_one_b(2, 2).unwrap());
    let bad = good.replace("\"RECV_F(0->1,m1)\",1F1", "1F1,\"RECV_F(0->1,m1)\"");
    assert_ne!(good, bad);
    let err = from_csv(&bad).unwrap_err();
    let FormatError::Invalid(inner) = &err else {
        panic!("{err}")
    };
    assert!(
        matches!(
            inner,
            ValidationError::MissingDependency {
                rank: 1,
                index: 4,
                ..
            }
        ),
        "{err}"
    );
    // The broken schedule can still be listed, with the culprit marked.
    let listing = render_programs(&parse_csv(&bad).unwrap(), inner.location());
    assert!(listing.lines().any(|l| l.contains("1F1 <<")), "{listing}");
    assert_eq!(
        listing.lines().nth(5).unwrap(),
        "    4 | RECV_B(1->0,m0) | 1F1 <<"
    );

    // A TOML schedule whose placement disagrees with its programs.
    let text = to_toml(&one_f_one_b(2, 2).unwrap()).replace(
        "stage_to_rank = [\n    0,\n    1,\n]",
        "stage_to_rank = [1, 0]",
    );
    let err = from_toml(&text).unwrap_err();
    assert!(
        matches!(
            err,
            FormatError::Invalid(ValidationError::WrongRank {
                rank: 0,
                owner: 1,
                ..
            })
        ),
        "{err}\n{text}"
    );
}
